"""Expert parallelism on CUDA with NCCL (``pytest -m gpu tests/test_gpu_parallel.py``).

- One GPU: the whole EP path (dispatch/combine over NCCL all-to-all, local experts, a rebalance with
  in-rank weight moves, the statistics collectives) on a process group of one rank, in float32, gives
  the plain engine's greedy tokens.
- Two or more GPUs (skipped otherwise): ``LLM(..., expert_parallel_size=N, device="cuda")`` starts N
  NCCL ranks and gives the single-GPU greedy tokens (float32, so bf16 routing near-ties cannot flip
  an expert), also with EPLB rebalancing every few steps mid-run.

NVLink multicast must stay off on the lent machines (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1); the rank processes inherit the
environment of the test process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_parallel_placement import world_of_one_rank_roundtrip
from tiny_deepseek import VOCAB, save_tiny_v3

from deepinfer import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory) -> Path:
    return save_tiny_v3(tmp_path_factory.mktemp("tiny-v3-gpu-ep"))


def test_expert_parallel_path_on_a_world_of_one_rank_nccl(tiny_v3):
    world_of_one_rank_roundtrip(tiny_v3, "cuda", "nccl")


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("eplb", [False, True])
def test_ep_over_gpus_gives_the_single_gpu_tokens(tiny_v3, eplb):
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (7, 50, 3, 21, 33, 12, 5, 40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = {"kv_cache_bytes": 1 << 24, "block_size": 16, "device": "cuda", "dtype": "float32"}
    ref = [o.outputs[0].token_ids for o in LLM(tiny_v3, **kw).generate(prompts, params, use_tqdm=False)]
    ranks = min(torch.cuda.device_count(), 4)
    plugins = {"eplb": {"enabled": True, "interval": 4, "window": 4, "num_redundant_experts": ranks}} if eplb else {}
    with LLM(tiny_v3, expert_parallel_size=ranks, plugins=plugins, **kw) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
        stats = llm.get_stats()
        assert stats["parallel"]["world_size"] == ranks
        if eplb:
            assert stats["eplb"]["rebalances"] >= 2


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_spec_decode_and_async_streaming_over_two_gpus_give_the_single_gpu_tokens(tiny_v3, tmp_path):
    """``tests/test_parallel_serving.py`` over NCCL: ``oracle`` drafts (accepted and rejected) under the
    ``varlen`` plan, whose step-cost curve both ranks profile together, and ``AsyncLLM`` streams."""
    import asyncio

    from spec_setup import repeating_prompts, spec_plugins, write_oracle_file

    from deepinfer.entrypoints.async_llm import AsyncLLM

    prompts = repeating_prompts(6, seed=3, low=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = {"kv_cache_bytes": 1 << 24, "block_size": 16, "device": "cuda", "dtype": "float32"}
    ref = [o.outputs[0].token_ids for o in LLM(tiny_v3, **kw).generate(prompts, params, use_tqdm=False)]
    spec = spec_plugins("oracle", "varlen", oracle_file=write_oracle_file(tmp_path, prompts, ref),
                        oracle_corruption=0.3)
    with LLM(tiny_v3, expert_parallel_size=2, max_num_seqs=8, plugins=spec, **kw) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
        stats = llm.get_stats()
        assert stats["spec_decode"]["verify_steps"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]

    async def stream_all(llm: AsyncLLM) -> list[list[int]]:
        async def one(prompt: list[int]) -> list[int]:
            outs = [out async for out in llm.generate(prompt, params)]
            assert len(outs) > 1 and outs[-1].finished
            return outs[-1].outputs[0].token_ids
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    with AsyncLLM(tiny_v3, expert_parallel_size=2, **kw) as llm:
        assert asyncio.run(stream_all(llm)) == ref
        stats = llm.get_stats()
        assert stats["num_running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
