"""On CUDA, the overlapped executor gives the synchronous executor's tokens (run with ``-m gpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams

REFS = Path(__file__).resolve().parents[3] / "tests" / "gpu_refs"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("launch", ["thread", "inline"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_overlap_equals_sync_on_cuda(name, dtype, launch):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 70, (12,), generator=gen)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=6 + 3 * i) for i in range(12)]
    outs = {}
    for executor in ("sync", "overlap"):
        llm = LLM(REFS / name, device="cuda", dtype=dtype, block_size=16, kv_cache_bytes=1 << 22,
                  plugins={"scheduling": {"enabled": executor == "overlap", "launch": launch}})
        outs[executor] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                          for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert outs["overlap"] == outs["sync"]


PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42], [7] * 20, [100, 3, 100, 3, 100]]
PARAMS = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=8 + 4 * i) for i in range(len(PROMPTS))]
SPEC = {"spec_decode": {"enabled": True, "drafter": "ngram", "plan": "fixed", "max_draft": 3}}


def _llm(guard: bool, plugins: dict | None = None, launch: str = "thread") -> LLM:
    return LLM(REFS / "llama", device="cuda", dtype="float32", block_size=16, kv_cache_bytes=1 << 22,
               plugins={"scheduling": {"enabled": True, "sync_guard": guard, "launch": launch}, **(plugins or {})})


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("launch", ["thread", "inline"])
@pytest.mark.parametrize("plugins", [{}, SPEC], ids=["plain", "spec_decode"])
def test_sync_guard_passes_a_run_without_hidden_syncs(plugins, launch):
    """The launch path (inputs through pinned buffers and non-blocking copies, forward, sampling or
    verification) never synchronizes: with the guard on the run completes, with the same tokens."""
    reference = LLM(REFS / "llama", device="cuda", dtype="float32", block_size=16, kv_cache_bytes=1 << 22,
                    plugins=plugins)
    expected = _tokens(reference)
    reference.shutdown()
    llm = _llm(True, plugins, launch)
    assert _tokens(llm) == expected
    assert torch.cuda.get_sync_debug_mode() == 0  # restored once no launch runs
    llm.shutdown()


@pytest.mark.parametrize("where", ["prepare", "execute"], ids=["host_inputs", "device_launch"])
def test_sync_guard_catches_a_planted_sync(where):
    """A ``.item()`` planted in the host's input building or in the device thread's launch raises with
    the guard on (the first step's launch runs before the host reads anything), and goes unnoticed
    without it."""
    for guard in (False, True):
        llm = _llm(guard)
        runner = llm.engine.runner
        original = getattr(runner, where)

        def planted(*args, _original=original, _device=runner.device, **kwargs):
            torch.ones(1, device=_device).item()  # a hidden device sync
            return _original(*args, **kwargs)

        setattr(runner, where, planted)
        try:
            if guard:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    _tokens(llm)
            else:
                assert len(_tokens(llm)) == len(PROMPTS)
        finally:
            llm.shutdown()
        assert torch.cuda.get_sync_debug_mode() == 0
