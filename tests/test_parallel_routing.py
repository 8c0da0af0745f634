"""Load-aware routing of new requests over data-parallel ranks (``parallel.router: least_requests``):
the policy, the loads ranks report with their step replies (requests, tokens, KV blocks in use), and 2
CPU gloo ranks where requests land on the less-loaded rank and every request gets the single-process
greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_deepseek import VOCAB, save_tiny_v3

from deepinfer import LLM, SamplingParams
from deepinfer.defaults import LeastRequestsRouter
from deepinfer.interfaces import RankLoad
from deepinfer.parallel.loads import RankLoads

KV = 1 << 22
BLOCK = 16
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_fewest_requests_then_fewest_kv_blocks_then_lowest_rank():
    router = LeastRequestsRouter()
    loads = [RankLoad(0, 2, 10, 1), RankLoad(1, 1, 90, 9), RankLoad(2, 1, 500, 4)]
    assert router.route(None, loads) == 2  # ranks 1 and 2 run one request each; rank 2 holds fewer blocks
    assert router.route(None, [RankLoad(0, 1, 0, 3), RankLoad(1, 1, 0, 3)]) == 0
    assert router.route(None, [RankLoad(0, 3, 0, 0), RankLoad(1, 2, 40, 30)]) == 1  # requests first


def test_a_reply_measured_before_a_routed_request_arrived_keeps_it_counted():
    loads = RankLoads(world=2, block_size=16)
    loads.routed_to(1, 40)
    loads.routed_to(1, 3)
    assert [(x.num_requests, x.num_tokens, x.num_kv_blocks) for x in loads.current()] == [(0, 0, 0), (2, 43, 4)]
    loads.reported(RankLoad(1, 0, 0, 0), requests_received=0)  # rank 1 stepped before either arrived
    assert loads.current()[1] == RankLoad(1, 2, 43, 4)
    loads.reported(RankLoad(1, 1, 41, 3), requests_received=1)  # the first arrived and prefilled
    assert loads.current()[1] == RankLoad(1, 2, 44, 4)
    loads.reported(RankLoad(1, 0, 0, 0), requests_received=2)  # both finished
    assert loads.current() == [RankLoad(0, 0, 0), RankLoad(1, 0, 0, 0)]
    assert loads.routed == [0, 2]


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory) -> Path:
    return save_tiny_v3(tmp_path_factory.mktemp("tiny-v3-routing"))


@pytest.mark.distributed
@pytest.mark.usefixtures("one_torch_thread")
def test_two_ranks_route_to_the_less_loaded_rank_and_give_the_single_process_tokens(tiny_v3):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (40, 3, 5, 9)]
    single = LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK)
    ref = [o.outputs[0].token_ids for o in single.generate(prompts, PARAMS, use_tqdm=False)]
    llm = LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK, expert_parallel_size=2,
              parallel={"router": "least_requests"})
    try:
        engine = llm.engine
        a, b, c, d = (engine.make_request(p, PARAMS) for p in prompts)
        engine.add(a)  # both idle: rank 0
        engine.add(b)  # rank 0 has a request: rank 1
        done = {o.request_id: o for o in engine.step()}  # a rank's reply, or both: loads as they report
        loads = engine.loads.current()
        assert [load.num_requests for load in loads] == [1, 1]
        assert [load.num_kv_blocks for load in loads] == [3, 1]  # 40 + 1 tokens in 16-token blocks; 3 + 1
        engine.add(c)  # one request each: the rank with fewer KV blocks, rank 1 (round robin: rank 0)
        assert llm.get_stats()["parallel"]["requests_per_rank"] == [1, 2]
        engine.add(d)  # rank 1 now has two requests: rank 0, although its cache is fuller
        assert llm.get_stats()["parallel"]["requests_per_rank"] == [2, 2]
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step()})
        assert [done[r.request_id].outputs[0].token_ids for r in (a, b, c, d)] == ref
        # every request finished: both ranks report an empty queue and no KV block in use
        assert [(load.num_requests, load.num_kv_blocks) for load in engine.loads.current()] == [(0, 0), (0, 0)]
    finally:
        llm.shutdown()
        single.shutdown()
