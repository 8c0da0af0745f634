"""CUDA-graph bookkeeping that runs on CPU: the bucket list and how a step is padded to its bucket
(the capture and replay themselves are checked on the GPU, ``tests/test_gpu_graphs.py``)."""

from __future__ import annotations

import time

import numpy as np

from deepinfer.config import build_config
from deepinfer.engine.cost import CurveCache, StepCost
from deepinfer.model.graphs import graph_buckets, pack_step


def test_buckets_are_1_2_4_then_every_interval_tokens():
    assert graph_buckets(1) == [1]
    assert graph_buckets(4) == [1, 2, 4]
    assert graph_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert graph_buckets(32, interval=16) == [1, 2, 4, 16, 32]


def test_a_step_is_padded_with_one_token_requests_then_empty_ones():
    # Two requests: a decode row at position 9 and a 3-token verification at positions 4..6.
    ids, positions, slots = [11, 21, 22, 23], [9, 4, 5, 6], [41, 52, 53, 54]
    packed, width = pack_step(8, ids, positions, slots, seq_lens=[10, 7], starts=[0, 1, 4],
                              tables=[[2, 3], [5]])
    assert width == 2
    t = 8
    assert packed[:t].tolist() == [11, 21, 22, 23, 0, 0, 0, 0]
    assert packed[t:2 * t].tolist() == [9, 4, 5, 6, 0, 0, 0, 0]
    assert packed[2 * t:3 * t].tolist() == [41, 52, 53, 54, 0, 0, 0, 0]   # padding writes scratch slot 0
    assert packed[3 * t:4 * t].tolist() == [10, 7, 1, 1, 1, 1, 0, 0]       # 4 padding requests, 2 empty
    assert packed[4 * t:5 * t + 1].tolist() == [0, 1, 4, 5, 6, 7, 8, 8, 8]
    assert packed[5 * t + 1:].reshape(2, 2).tolist() == [[2, 3], [5, 0]]
    # Every query token belongs to exactly one request, and the starts never decrease.
    qsl = packed[4 * t:5 * t + 1]
    assert np.all(np.diff(qsl) >= 0) and qsl[-1] == t


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
