"""Prefix caching: lossless, and a repeated system prompt is a hit."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.kv.blocks import BlockPool, KVCacheManager


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("qwen2", tmp_path_factory.mktemp("prefix"))[1]


def _conversations(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 256, (70,), generator=gen).tolist()  # 4+ blocks of 16
    return [system + torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (3, 17, 33, 8)]


def _run(folder, prefix_caching: bool, prompts, params):
    llm = LLM(folder, kv_cache_bytes=1 << 23, block_size=16, cache={"prefix_caching": prefix_caching})
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in first + rest], llm.get_stats()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                    SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=3,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_prefix_caching_is_lossless_and_hits(tiny_dir, params):
    prompts = _conversations(1)
    on, stats_on = _run(tiny_dir, True, prompts, params)
    off, stats_off = _run(tiny_dir, False, prompts, params)
    assert on == off
    assert stats_on["prefix_cache_hit_rate"] > 0.5
    assert stats_off["prefix_cache_hit_rate"] == 0.0
    assert stats_on["kv_blocks_free"] == stats_on["kv_blocks_total"]


def test_block_pool_reuses_cached_blocks_and_evicts_lru():
    pool = BlockPool(num_blocks=5, enable_prefix_caching=True)  # 4 usable
    a = pool.allocate(2)
    pool.register(a[0], b"h0")
    pool.register(a[1], b"h1")
    pool.free(a)
    assert pool.num_free == 4 and pool.lookup(b"h0") == a[0]
    pool.touch([a[0]])  # a hit takes the block out of the free queue
    assert pool.num_free == 3
    fresh = pool.allocate(3)  # two uncached blocks first, then evicts the cached one with ref 0
    assert fresh is not None and a[1] in fresh and pool.lookup(b"h1") is None
    assert pool.lookup(b"h0") == a[0]
    assert pool.allocate(1) is None


def test_manager_shares_a_prefix_and_never_hits_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    tokens = list(range(12))
    assert kv.allocate("a", 12)
    kv.cache_full_blocks("a", tokens, 12)
    hit = kv.find_prefix("b", tokens)
    assert hit.num_tokens == 8  # 3 full blocks cached, but the last token must be computed
    assert kv.allocate("b", 12, hit)
    assert kv.table("b")[:2] == kv.table("a")[:2] and kv.table("b")[2] != kv.table("a")[2]
    kv.forget("a")
    kv.forget("b")
    assert kv.num_free_blocks == 9
