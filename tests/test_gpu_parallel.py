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
