"""On CUDA, the overlapped executor gives the synchronous executor's tokens (run with ``-m gpu``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams

REFS = Path(__file__).resolve().parents[3] / "tests" / "gpu_refs"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_overlap_equals_sync_on_cuda(name, dtype):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(3, 70, (12,), generator=gen)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=6 + 3 * i) for i in range(12)]
    outs = {}
    for executor in ("sync", "overlap"):
        llm = LLM(REFS / name, device="cuda", dtype=dtype, block_size=16, kv_cache_bytes=1 << 22,
                  plugins={"scheduling": {"enabled": executor == "overlap"}})
        outs[executor] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                          for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert outs["overlap"] == outs["sync"]
