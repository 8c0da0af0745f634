"""The overlapped executor gives the synchronous executor's outputs, and leaks nothing."""

from __future__ import annotations

import json
import random
import threading
from types import SimpleNamespace

import pytest
import torch
from abort_drills import drain_with_random_aborts
from deepinfer_scheduling.overlap import OverlapExecutor
from tiny_models import TINY, save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError

OVERLAP = {"scheduling": {"enabled": True}}


def _prompts(n: int, seed: int, vocab: int = 256, lo: int = 3, hi: int = 60) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=gen)
    return [torch.randint(0, vocab, (int(k),), generator=gen).tolist() for k in lengths]


def _params(n: int) -> list[SamplingParams]:
    # greedy and seeded sampling, short and long outputs; EOS stops happen mid-stream
    return [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=100 + i, max_tokens=4 + 5 * (i % 7))
            for i in range(n)]


def _kv_bytes(blocks: int, head_dim: int = 16) -> int:
    return blocks * 2 * 16 * 2 * head_dim * 4 * 2  # K+V × block 16 × 2 kv heads × head_dim × fp32 × 2 layers


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny_dir(request, tmp_path_factory):
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))[1]


def _run(folder, plugins, prompts, params, **kw):
    llm = LLM(folder, block_size=16, plugins=plugins, scheduler={"executor": "overlap" if plugins else "sync"}, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], llm


def test_overlap_equals_sync(tiny_dir):
    prompts, params = _prompts(14, 1), _params(14)
    sync, _ = _run(tiny_dir, {}, prompts, params, kv_cache_bytes=1 << 22)
    overlap, llm = _run(tiny_dir, OVERLAP, prompts, params, kv_cache_bytes=1 << 22)
    assert type(llm.engine.executor).__name__ == "OverlapExecutor"
    assert overlap == sync
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["scheduling"]["device_steps"] > 0


def test_overlap_equals_sync_under_preemption(tiny_dir):
    head_dim = json.loads((tiny_dir / "config.json").read_text()).get("head_dim") or 16
    prompts, params = _prompts(10, 2, lo=5, hi=40), [SamplingParams(temperature=0.8, seed=i, max_tokens=30,
                                                                     ignore_eos=True) for i in range(10)]
    sync, _ = _run(tiny_dir, {}, prompts, params, kv_cache_bytes=1 << 22, max_model_len=128)
    overlap, llm = _run(tiny_dir, OVERLAP, prompts, params, kv_cache_bytes=_kv_bytes(13, head_dim),
                           max_model_len=128)
    stats = llm.get_stats()
    assert stats["preemptions"] > 0
    assert overlap == sync
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_smollm2_overlap_equals_sync(smollm2_dir):
    prompts = ["The three primary colors are", "def fibonacci(n):\n    ", "Once upon a time,"]
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.7, seed=5, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24, stop=["."])]
    sync, _ = _run(smollm2_dir, {}, prompts, params, kv_cache_bytes=1 << 27, max_model_len=512)
    overlap, _ = _run(smollm2_dir, OVERLAP, prompts, params, kv_cache_bytes=1 << 27, max_model_len=512)
    assert overlap == sync


def test_aborts_in_flight_and_a_thousand_requests_leak_nothing(tmp_path):
    folder = save_tiny("llama", tmp_path)[1]
    llm = LLM(folder, block_size=16, plugins=OVERLAP, scheduler={"executor": "overlap"}, kv_cache_bytes=_kv_bytes(13),
              max_model_len=128, max_num_seqs=16)
    engine = llm.engine
    rng = random.Random(7)
    requests = [engine.make_request(p, SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randint(1, 12)))
                for i, p in enumerate(_prompts(1000, 3, lo=1, hi=30))]
    finished = drain_with_random_aborts(llm, requests, rng)  # aborted requests have their step in flight
    assert {"abort", "length"} <= set(finished.values())
    stats = llm.get_stats()
    assert stats["preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not engine.core.inflight and not engine.core.awaiting_release


def test_env_knob_enables_overlap(tmp_path, monkeypatch):
    """The knob enables the plugin, so ``overlap`` can be named; on this CPU device ``auto`` stays synchronous."""
    folder = save_tiny("llama", tmp_path)[1]
    monkeypatch.setenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "1")
    llm = LLM(folder, block_size=16, kv_cache_bytes=1 << 20, scheduler={"executor": "overlap"})
    assert type(llm.engine.executor).__name__ == "OverlapExecutor"
    llm = LLM(folder, block_size=16, kv_cache_bytes=1 << 20)
    assert type(llm.engine.executor).__name__ == "SyncExecutor"
    monkeypatch.delenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING")
    llm = LLM(folder, block_size=16, kv_cache_bytes=1 << 20)
    assert type(llm.engine.executor).__name__ == "SyncExecutor"
    with pytest.raises(ConfigError, match="overlap"):
        LLM(folder, block_size=16, kv_cache_bytes=1 << 20, scheduler={"executor": "overlap"})


class _RecordingContext:
    """A step context that records which thread did what, in order; step N's results are N."""

    def __init__(self, steps: int) -> None:
        self.left = steps
        self.scheduled = 0
        self.calls: list[tuple[str, int | None, str]] = []

    def _note(self, what: str, step: int | None) -> None:
        self.calls.append((what, step, threading.current_thread().name))

    def schedule(self):
        self.left -= 1
        scheduled = SimpleNamespace(is_empty=self.left < 0, step=self.scheduled)
        self.scheduled += not scheduled.is_empty
        self._note("schedule", scheduled.step)
        return scheduled

    def prepare(self, scheduled, previous=None):
        self._note("prepare", scheduled.step)
        return scheduled.step

    def run(self, prepared, previous_results=None):
        assert previous_results == (None if prepared == 0 else prepared - 1)  # the steps run in order
        self._note("run", prepared)
        return prepared

    def process(self, scheduled, results):
        self._note("process", results)
        return [] if results is None else [results]


@pytest.mark.parametrize("inline", [False, True], ids=["thread", "inline"])
def test_step_n_plus_1_is_launched_before_step_n_is_processed(inline):
    """Step N+1 is handed to the device before the host processes step N: ``inline`` runs its launch on the
    caller's thread, so before that processing; ``thread`` on the worker, in step order."""
    context = _RecordingContext(3)
    executor = OverlapExecutor(context, inline=inline)
    outputs = [executor.step() for _ in range(4)]
    executor.shutdown()
    assert outputs == [[], [0], [1], [2]]
    order = [(what, step) for what, step, _ in context.calls if what in ("run", "process")]
    if inline:
        assert order == [("run", 0), ("process", None), ("run", 1), ("process", 0), ("run", 2), ("process", 1),
                         ("process", 2)]
    else:
        assert [step for what, step in order if what == "run"] == [0, 1, 2]
    runners = {thread for what, _, thread in context.calls if what == "run"}
    assert (runners == {threading.current_thread().name}) is inline
    stats = executor.timeline.stats()
    if inline:  # no worker: the device's own busy and idle time is the core's (CUDA events)
        assert "device_steps" not in stats and stats["host_wait_s"] >= 0
    else:
        assert stats["device_steps"] == 3


def test_inline_launch_needs_a_cuda_device(tmp_path):
    folder = save_tiny("llama", tmp_path)[1]
    with pytest.raises(ConfigError, match=r"plugins\.scheduling\.launch"):
        LLM(folder, block_size=16, kv_cache_bytes=1 << 20, scheduler={"executor": "overlap"},
            plugins={"scheduling": {"enabled": True, "launch": "inline"}})
