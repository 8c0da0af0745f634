"""An interrupted ``generate()`` (Ctrl-C, or any exception raised inside a step) leaves a clean engine.

An interrupt is planted at every phase of the step — before and after each core primitive, inside the
scheduler, between committing tokens and the stop checks, in the drafter — with the synchronous and the
overlapped executor, with and without speculative decoding. Each time the exception must reach the
caller, every KV block must be free again with nothing queued or counted in flight, and the next
``generate()`` must give the tokens a fresh engine gives.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams

pytest.importorskip("deepinfer_scheduling")
pytest.importorskip("deepinfer_spec_decode")

CONFIGS = {
    "sync": {},
    "overlap": {"scheduling": {"enabled": True}},
    "sync+spec": {"spec_decode": {"enabled": True, "drafter": "ngram", "plan": "fixed", "max_draft": 3}},
    "overlap+spec": {"scheduling": {"enabled": True},
                     "spec_decode": {"enabled": True, "drafter": "ngram", "plan": "fixed", "max_draft": 3}},
}

# (object, method, when): ``before`` raises instead of calling the method, ``after`` once it has returned
# (its changes made). ``core.run`` runs on the overlapped executor's device thread.
PHASES = [
    ("core", "schedule", "before"), ("core", "schedule", "after"),
    ("scheduler", "schedule", "after"),  # blocks taken, optimistic state not yet advanced
    ("core", "prepare", "before"), ("core", "prepare", "after"),
    ("core", "run", "before"), ("core", "run", "after"),
    ("core", "process", "before"), ("core", "process", "after"),
    ("core", "_stop_reason", "after"),  # tokens of the step committed, stop checks half done
    ("core", "output_of", "after"),
]
SPEC_PHASES = [("speculator", "draft", "before"), ("speculator", "draft", "after"),
               ("speculator", "keep", "before"), ("speculator", "keep", "after")]


class PlantedInterrupt(KeyboardInterrupt):
    """The planted Ctrl-C (a ``KeyboardInterrupt``, so nothing may swallow it as an ``Exception``)."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("interrupts"))[1]


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 30, (4,), generator=gen)
    bodies = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in lengths]
    return [b + b[:6] if i % 2 else b for i, b in enumerate(bodies)]  # repeats: n-gram drafts


PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _plant(monkeypatch: pytest.MonkeyPatch, target: Any, name: str, when: str, nth: int) -> list[int]:
    """Make ``target.name`` raise ``PlantedInterrupt`` on its ``nth`` call; returns the call counter."""
    inner: Callable[..., Any] = getattr(target, name)
    calls = [0]

    def planted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth and when == "before":
            raise PlantedInterrupt(f"{name} before")
        out = inner(*args, **kwargs)
        if calls[0] == nth:
            raise PlantedInterrupt(f"{name} after")
        return out

    monkeypatch.setattr(target, name, planted)
    return calls


def _assert_clean(llm: LLM) -> None:
    engine = llm.engine
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert not engine.core.inflight and not engine.core.awaiting_release
    assert not engine.kv.tables and not engine.kv.slots


@pytest.mark.parametrize("config", list(CONFIGS))
def test_interrupt_at_every_phase_leaves_a_clean_engine(tiny_dir, config):
    prompts = _prompts(3)
    llm = LLM(tiny_dir, block_size=16, kv_cache_bytes=1 << 21, max_num_seqs=4, plugins=CONFIGS[config],
              scheduler={"executor": config.split("+")[0]})
    engine = llm.engine
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    targets = {"core": engine.core, "scheduler": engine.scheduler, "speculator": engine.speculator}
    phases = PHASES + (SPEC_PHASES if engine.speculator is not None else [])
    for obj, name, when in phases:
        for nth in (1, 3):
            with pytest.MonkeyPatch.context() as mp:
                calls = _plant(mp, targets[obj], name, when, nth)
                with pytest.raises(PlantedInterrupt):
                    llm.generate(prompts, PARAMS, use_tqdm=False)
                assert calls[0] >= nth, f"{obj}.{name} never ran {nth} times"
            _assert_clean(llm)
            again = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
            assert again == want, f"after an interrupt at {obj}.{name} ({when}, call {nth})"
            _assert_clean(llm)


def test_a_plugin_that_raises_in_a_step_aborts_the_live_requests(tiny_dir):
    """An exception (not an interrupt) from a step observer: it propagates, the live requests end
    aborted with an error naming it, and their outputs come with the next step."""
    llm = LLM(tiny_dir, block_size=16, kv_cache_bytes=1 << 21, max_num_seqs=4)
    engine = llm.engine
    requests = [engine.make_request(p, PARAMS) for p in _prompts(5)]
    for r in requests:
        engine.add(r)
    engine.step()

    def broken(stats):
        raise RuntimeError("observer bug")

    engine.core.on_step_end = broken
    with pytest.raises(RuntimeError, match="observer bug"):
        engine.step()
    engine.core.on_step_end = None
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == sorted(r.request_id for r in requests)
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "abort"
        assert "RuntimeError" in o.outputs[0].error
    assert not engine.has_unfinished()
    _assert_clean(llm)


@pytest.mark.parametrize("config", ["sync", "overlap"])
def test_sigint_during_generate(tiny_dir, config):
    """The issue's reproduction: a real SIGINT lands wherever the main thread is during ``generate``. (Python's
    own handler is put in place first: a process started in the background of a non-interactive shell
    inherits SIGINT ignored.)"""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _sigint_drill(tiny_dir, config)
    finally:
        signal.signal(signal.SIGINT, previous)


def _sigint_drill(tiny_dir, config) -> None:
    llm = LLM(tiny_dir, block_size=16, kv_cache_bytes=1 << 21, max_num_seqs=4, plugins=CONFIGS[config],
              scheduler={"executor": config.split("+")[0]})
    prompts = _prompts(7) + _prompts(8)
    many = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)]
    runs = []
    for _ in range(2):  # the first run is the slower one (warm-up): the signal must land inside a warm run
        start = time.perf_counter()
        llm.generate(prompts, [many] * len(prompts), use_tqdm=False)
        runs.append(time.perf_counter() - start)
    whole = min(runs)  # the signal lands early, midway and late in a run of this length
    for delay in (0.1 * whole, 0.35 * whole, 0.6 * whole):
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompts, [many] * len(prompts), use_tqdm=False)
        finally:
            timer.cancel()
        _assert_clean(llm)
        assert [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)] == want
