"""CUDA-graph bookkeeping that runs on CPU: the bucket list, how a step is padded to its bucket, and
that an emulated replay's padding rows stay out of the router statistics (the capture and replay
themselves are checked on the GPU, ``tests/test_gpu_graphs.py``)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from test_deepseek_v3 import _build, _prompts
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.config import build_config
from deepinfer.engine.cost import CurveCache, StepCost
from deepinfer.engine.graphs import DecodeGraphs, graph_buckets, pack_step
from deepinfer.interfaces import ForwardContext


def test_buckets_are_1_2_4_then_every_interval_tokens():
    assert graph_buckets(1) == [1]
    assert graph_buckets(4) == [1, 2, 4]
    assert graph_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert graph_buckets(32, interval=16) == [1, 2, 4, 16, 32]


def test_a_step_is_padded_with_one_token_requests_then_empty_ones():
    # Two requests: a decode row at position 9 and a 3-token verification at positions 4..6.
    ids, positions, slots = [11, 21, 22, 23], [9, 4, 5, 6], [41, 52, 53, 54]
    packed, width = pack_step(8, ids, positions, slots, seq_lens=[10, 7], starts=[0, 1, 4],
                              tables=[[2, 3], [5]], state_slots=[6, 3])
    assert width == 2
    t = 8
    assert packed[:t].tolist() == [11, 21, 22, 23, 0, 0, 0, 0]
    assert packed[t:2 * t].tolist() == [9, 4, 5, 6, 0, 0, 0, 0]
    assert packed[2 * t:3 * t].tolist() == [41, 52, 53, 54, 0, 0, 0, 0]   # padding writes scratch slot 0
    assert packed[3 * t:4 * t].tolist() == [10, 7, 1, 1, 1, 1, 0, 0]       # 4 padding requests, 2 empty
    assert packed[4 * t] == 4                                              # real tokens
    assert packed[4 * t + 1:5 * t + 2].tolist() == [0, 1, 4, 5, 6, 7, 8, 8, 8]
    assert packed[5 * t + 2:6 * t + 2].tolist() == [6, 3, 0, 0, 0, 0, 0, 0]  # padding: reserved state slot 0
    assert packed[6 * t + 2:].reshape(2, 2).tolist() == [[2, 3], [5, 0]]
    # Every query token belongs to exactly one request, and the starts never decrease.
    qsl = packed[4 * t + 1:5 * t + 2]
    assert np.all(np.diff(qsl) >= 0) and qsl[-1] == t


@pytest.mark.usefixtures("one_torch_thread")
def test_router_stats_skip_the_padding_rows_of_a_replayed_bucket(tmp_path):
    """5 real tokens replayed in the 8-token bucket (3 padding rows) count exactly as the same 5 tokens
    run eagerly: rows sum to 5 × top_k. The step is 5 first tokens (position 0) so that the reference
    MLA backend, which reads the capture's host lists under an emulated replay, computes them right."""
    block = 16
    _build("v3-noqlora", tmp_path)  # every layer MoE, top-3
    top_k = json.loads((tmp_path / "config.json").read_text())["num_experts_per_tok"]
    llm = LLM(tmp_path, kv_cache_bytes=1 << 22, block_size=block)
    model, backends = llm.engine.model, llm.engine.runner.backends
    graphs = DecodeGraphs(model, backends, block, torch.device("cpu"), max_tokens=8, max_query_lens=(1,),
                          max_blocks=2, emulate=True)
    graphs.capture()
    ids, tables = _prompts([5], seed=11)[0], [[b] for b in range(1, 6)]
    slots, n = [t[0] * block for t in tables], len(ids)
    bucket = graphs.bucket_for(n, 1)
    assert bucket == (8, 1)
    model.take_router_stats()
    with torch.inference_mode():
        graphs.replay(bucket)  # before any step is loaded (start-up profiling): all padding
        assert model.take_router_stats().sum() == 0
        graphs.load(graphs.stage(bucket, ids, [0] * n, slots, [1] * n, list(range(n + 1)), tables))
        replayed, _ = graphs.replay(bucket)
        replayed_stats = model.take_router_stats()
        ctx = ForwardContext(
            positions=torch.zeros(n, dtype=torch.int64), slot_mapping=torch.tensor(slots),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=torch.ones(n, dtype=torch.int64),
            block_tables=torch.tensor(tables), num_decodes=n, query_start_loc_host=list(range(n + 1)),
            seq_lens_host=[1] * n, block_size=block, backends=backends)
        eager = model.forward(torch.tensor(ids), ctx)
        eager_stats = model.take_router_stats()
    torch.testing.assert_close(replayed[:n], eager)
    assert torch.equal(replayed_stats.sum(dim=1), torch.full((len(model.moe_layer_ids),), n * top_k))
    assert torch.equal(replayed_stats, eager_stats)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_profiling_replay_routes_its_rows_to_many_experts(tmp_path):
    """The step-cost profile replays each bucket on ``load_placeholder``'s inputs (random ids, distinct
    positions): on the capture's own inputs (id 0 at position 0 in every row) a learned router sends all
    rows to the same top-k experts, and the profile would time a step that reads only those."""
    block = 16
    _build("v3-noqlora", tmp_path)
    llm = LLM(tmp_path, kv_cache_bytes=1 << 22, block_size=block)
    model, backends = llm.engine.model, llm.engine.runner.backends
    graphs = DecodeGraphs(model, backends, block, torch.device("cpu"), max_tokens=8, max_query_lens=(1,),
                          max_blocks=2, emulate=True)
    graphs.capture()
    chosen: list[torch.Tensor] = []
    for layer in (m for m in model.modules() if hasattr(m, "route")):
        route = layer.route

        def recording(*args, route=route, **kwargs):
            ids, weights = route(*args, **kwargs)
            chosen.append(ids)
            return ids, weights

        layer.route = recording

    def experts_per_layer() -> list[int]:
        counts = [len(ids.unique()) for ids in chosen]
        chosen.clear()
        return counts

    top_k = json.loads((tmp_path / "config.json").read_text())["num_experts_per_tok"]
    with torch.inference_mode():
        graphs.replay((8, 1))
        assert set(experts_per_layer()) == {top_k}  # the capture's inputs: one hidden state per layer
    graphs.load_placeholder((8, 1))  # (start-up calls it outside inference mode)
    with torch.inference_mode():
        assert len(graphs.graphs[(8, 1)].input_ids.unique()) > 1
        assert graphs.graphs[(8, 1)].ctx.positions.tolist() == list(range(8))
        graphs.replay((8, 1))
        spread = experts_per_layer()
        assert sum(spread) > top_k * len(spread)  # (a tiny random router may still pick one set in a layer)


def test_enforce_eager_and_the_bucket_interval_map_onto_kernels():
    cfg = build_config(environ={"DEEPINFER_ENFORCE_EAGER": "1", "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL": "16"}).config
    assert cfg.kernels.cuda_graphs is False and cfg.kernels.cuda_graph_interval == 16


def test_a_cached_step_cost_curve_is_reused_until_it_expires(tmp_path, monkeypatch):
    calls = []

    def measure(q: int) -> float:
        calls.append(q)
        return 0.001 * q

    key = {"model": "m", "buckets": [1, 2, 4]}
    cache = CurveCache(tmp_path, ttl_s=60)
    assert cache.load(key) is None
    cost = StepCost(measure, 4, sizes=[1, 2, 4])
    cost.profile_all()
    assert calls == [1, 2, 4]
    cache.save(key, cost.points)
    again = StepCost(measure, 4, sizes=[1, 2, 4])
    again.load(cache.load(key))
    assert again.step_time(3) == cost.step_time(3) and calls == [1, 2, 4]  # nothing re-measured
    assert cache.load({**key, "buckets": [1, 2]}) is None  # another run shape
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 61)
    assert cache.load(key) is None  # expired


def test_an_eager_curve_is_cached_as_it_is_profiled_and_resumed_by_the_next_model(tmp_path):
    calls: list[int] = []

    def measure(q: int) -> float:
        calls.append(q)
        return 0.001 * q

    key = {"model": "m", "buckets": "eager"}
    cache = CurveCache(tmp_path, ttl_s=60)
    cost = StepCost(measure, 64)
    cost.on_profiled = lambda points: cache.save(key, points)
    cost.step_time(5)  # profiles the powers of two up to the first at or above 5
    assert calls == [1, 2, 4, 8] and cache.load(key) == cost.points
    again = StepCost(measure, 64)
    again.load(cache.load(key))
    calls.clear()
    assert again.step_time(5) == cost.step_time(5) and calls == []  # nothing re-measured
    again.step_time(20)
    assert calls == [16, 32]  # only the sizes the cache lacks


@pytest.mark.usefixtures("one_torch_thread")
def test_an_engine_keeps_its_eager_step_cost_curve_for_the_next(tmp_path):
    """``scheduler.step_cost_cache_dir`` on an eager (CPU) engine with ``varlen``: the points its steps
    profiled are on disk, and the next engine of the same shape starts with them."""
    folder = save_tiny("llama", tmp_path / "llama")[1]
    kw = {"kv_cache_bytes": 1 << 22, "block_size": 16, "plugins": {"spec_decode": {
        "enabled": True, "drafter": "ngram", "plan": "varlen", "max_draft": 3}},
        "scheduler": {"step_cost_cache_dir": str(tmp_path / "curves")}}
    llm = LLM(folder, **kw)
    llm.generate([[1, 2, 3, 1, 2, 3, 1, 2]] * 3, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    points = llm.engine.speculator.cost.points
    llm.shutdown()
    assert points and list((tmp_path / "curves").glob("step-cost-*.json"))
    again = LLM(folder, **kw)
    assert again.engine.speculator.cost.points == points
    again.shutdown()
