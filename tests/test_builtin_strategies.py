"""The built-in plugin's strategies as plain objects: pure decisions on small inputs."""

from __future__ import annotations

import pytest
from fakes import FakeRequest

from deepinfer.defaults import ExactReplayPlanner, FCFSPolicy, RoundRobinRouter
from deepinfer.errors import ConfigError
from deepinfer.interfaces import CacheLayout, LayerCacheInfo, RankLoad


def test_fcfs_admits_by_arrival_and_preempts_the_latest():
    reqs = [FakeRequest("a", 3.0), FakeRequest("b", 1.0), FakeRequest("c", 2.0)]
    policy = FCFSPolicy()
    assert [r.request_id for r in policy.order(reqs, now=5.0)] == ["b", "c", "a"]
    assert policy.preemption_victim(reqs).request_id == "a"


def test_round_robin_deals_in_turn():
    router = RoundRobinRouter()
    loads = [RankLoad(rank=r, num_requests=0, num_tokens=0) for r in range(3)]
    assert [router.route(FakeRequest(str(i), 0.0), loads) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_exact_replay_covers_the_receptive_field():
    planner = ExactReplayPlanner()
    req = FakeRequest("a", 0.0, num_computed_tokens=1000)
    dense = CacheLayout((LayerCacheInfo("full"),) * 4, block_size=128, max_backtrack=1)
    assert planner.plan(req, dense, "prefix_hit").first_token == 1000  # nothing to rebuild
    sliding = CacheLayout((LayerCacheInfo("sliding", window=64), LayerCacheInfo("full"),
                           LayerCacheInfo("sliding", window=32)), block_size=128, max_backtrack=6)
    plan = planner.plan(req, sliding, "preempted")
    assert plan.first_token == 1000 - 2 * (64 + 6) and plan.mode == "full"
    assert planner.plan(FakeRequest("b", 0.0, num_computed_tokens=50), sliding, "prefix_hit").first_token == 0


def test_misspelt_strategy_names_fail_at_start(tiny_llama_dir):
    from deepinfer import LLM

    with pytest.raises(ConfigError, match=r"cache\.replay: unknown name 'exakt'"):
        LLM(tiny_llama_dir, kv_cache_bytes=1 << 20, block_size=16, cache={"replay": "exakt"})
    with pytest.raises(ConfigError, match=r"parallel\.router: unknown name"):
        LLM(tiny_llama_dir, kv_cache_bytes=1 << 20, block_size=16, parallel={"router": "random"})
