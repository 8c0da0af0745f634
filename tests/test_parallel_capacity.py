"""Fixed-capacity expert-parallel dispatch (``kernels.dispatch: torch_all_to_all_capacity``,
``parallel/capacity.py``) over CPU gloo ranks: the single-process greedy tokens at 2 ranks, with the
worst-case capacity (no overflow, no check) and with a capacity so small that most pairs overflow into
the counted exact-split exchange (and at 4 ranks with half the even share); how the per-pair capacity is
sized; config errors that name the key; on a GPU, a world of one NCCL rank replayed from a CUDA graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_deepseek import random_prompts, save_tiny_v3

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.parallel.capacity import CapacityAllToAllBackend
from deepinfer.parallel.dispatch import AllToAllBackend, PairCapacity
from deepinfer.parallel.moe import pair_capacity

KV = 1 << 22
BLOCK = 16
MAX_NEW = 10
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
CAPACITY = "torch_all_to_all_capacity"


PROMPTS = random_prompts([5, 40, 17, 3, 29, 11], seed=11)


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory) -> Path:
    return save_tiny_v3(tmp_path_factory.mktemp("tiny-v3-capacity"))


@pytest.fixture(scope="module")
def reference(tiny_v3) -> list[list[int]]:
    llm = LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_pair_capacity_is_the_worst_case_or_the_factors_share():
    # T=10 tokens, top-2, 2 ranks: the worst case is every choice on one rank, 20 rows
    assert pair_capacity(10, 2, 2, None) == PairCapacity(20, True)
    assert pair_capacity(10, 2, 2, 1.25) == PairCapacity(13, False)  # ceil(1.25 · 10 · 2 / 2)
    assert pair_capacity(10, 2, 2, 64.0) == PairCapacity(20, True)  # capped at the worst case
    assert pair_capacity(0, 2, 2, None) == PairCapacity(1, True)  # every rank idle: still one row
    assert pair_capacity(3, 6, 8, 0.01) == PairCapacity(1, False)


def test_bad_capacity_settings_name_the_key(tiny_v3):
    with pytest.raises(ConfigError, match=r"parallel\.dispatch_capacity_factor"):
        LLM(tiny_v3, kv_cache_bytes=KV, parallel={"dispatch_capacity_factor": 0})
    with pytest.raises(ConfigError, match=r"parallel\.dispatch_capacity_factor"):
        LLM(tiny_v3, kv_cache_bytes=KV, parallel={"dispatch_capacity_factor": 100})
    with pytest.raises(ConfigError, match=r"kernels\.dispatch: backend 'torch' does not implement"):
        LLM(tiny_v3, kv_cache_bytes=KV, kernels={"dispatch": "torch"})
    with pytest.raises(ConfigError, match=r"kernels\.dispatch: unknown backend 'nccl_magic'"):
        LLM(tiny_v3, kv_cache_bytes=KV, kernels={"dispatch": "nccl_magic"})


def _exchange(rank: int, world: int, store_path: str, results: str) -> None:
    """One rank of ``test_backends_agree_bitwise``: the exact and the fixed-capacity backends on the same
    random pairs, with a stand-in expert (row · (slot + 1)); saves both outputs and the overflow count."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        tokens, top_k, slots = (7, 0)[rank], 3, 4  # rank 1 idle: it still joins every exchange
        x = torch.randn(tokens, 8, generator=gen)
        phys = torch.stack([torch.randperm(world * slots, generator=gen)[:top_k] for _ in range(tokens)]) \
            if tokens else torch.zeros(0, top_k, dtype=torch.int64)
        weights = torch.rand(tokens, top_k, generator=gen)
        out = {}
        for name, backend, capacity in (("exact", AllToAllBackend(), None),
                                        ("worst", CapacityAllToAllBackend(), PairCapacity(7 * top_k, True)),
                                        ("tiny", CapacityAllToAllBackend(), PairCapacity(2, False))):
            x_recv, slot_recv, handle = backend.dispatch(x, phys // slots, phys % slots, world=world,
                                                         capacity=capacity)
            y = x_recv * (slot_recv.unsqueeze(1) + 1).to(x.dtype)
            out[name] = backend.combine(y, handle, weights)
            out[f"{name}_overflow"] = getattr(backend, "overflow", None)
        torch.save({k: (v.__dict__ if hasattr(v, "pairs") else v) for k, v in out.items()}, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_backends_agree_bitwise(tmp_path):
    """Fixed capacity, with the worst-case rows or with 2 rows per pair (overflow through the exact
    exchange), gives bitwise the exact path's combined outputs, an idle rank included."""
    import torch.multiprocessing as mp

    results = str(tmp_path / "out")
    mp.spawn(_exchange, args=(2, str(tmp_path / "store"), results), nprocs=2)
    busy, idle = torch.load(f"{results}.0"), torch.load(f"{results}.1")
    assert busy["exact"].shape == (7, 8) and idle["exact"].shape == (0, 8)
    for name in ("worst", "tiny"):
        assert torch.equal(busy[name], busy["exact"]) and torch.equal(idle[name], idle["exact"])
    assert busy["worst_overflow"] == {"pairs": 0, "exchanges": 0}
    # 21 pairs over 2 destinations with 2 rows each: at least 17 overflow, one exchange on both ranks
    assert busy["tiny_overflow"]["pairs"] >= 17 and busy["tiny_overflow"]["exchanges"] == 1
    assert idle["tiny_overflow"] == {"pairs": 0, "exchanges": 1}


@pytest.mark.distributed
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("ranks", "factor", "overflows"), [(2, None, False), (2, 0.01, True), (4, 0.5, True)],
                         ids=["2-worst-case", "2-overflow", "4-overflow"])
def test_fixed_capacity_gives_the_single_process_tokens(tiny_v3, reference, ranks, factor, overflows):
    llm = LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK, expert_parallel_size=ranks,
              kernels={"dispatch": CAPACITY}, parallel={"dispatch_capacity_factor": factor})
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        parallel = llm.get_stats()["parallel"]
    finally:
        llm.shutdown()
    assert parallel["dispatch_calls"] > 0
    if overflows:
        # few rows per rank pair: a rank with more pairs for a destination overflows, and the layer
        # calls where some rank did took the exact exchange (counted alike on every rank)
        assert parallel["dispatch_overflow_pairs"] > len(PROMPTS)
        assert 0 < parallel["dispatch_overflow_exchanges"] <= parallel["dispatch_calls"] // ranks
    else:
        assert parallel["dispatch_overflow_pairs"] == 0
        assert parallel["dispatch_overflow_exchanges"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fixed_capacity_on_a_world_of_one_nccl_rank_replays_in_a_cuda_graph():
    """NCCL, one rank: both capacities give bitwise the exact path's outputs, and the worst-case path
    (no host read) captured in a CUDA graph replays to them on new inputs."""
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        tokens, hidden, top_k, slots = 13, 64, 3, 8

        def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            x = torch.randn(tokens, hidden, device="cuda", generator=gen)
            ids = torch.rand(tokens, slots, device="cuda", generator=gen).argsort(dim=1)[:, :top_k]
            return x, ids, torch.rand(tokens, top_k, device="cuda", generator=gen)

        def run(backend, x, ids, weights, capacity):
            x_recv, slot_recv, handle = backend.dispatch(x, torch.zeros_like(ids), ids, world=1, capacity=capacity)
            return backend.combine(x_recv * (slot_recv.unsqueeze(1) + 1).to(x.dtype), handle, weights)

        exact, fixed = AllToAllBackend(), CapacityAllToAllBackend()
        worst = PairCapacity(tokens * top_k, True)
        x, ids, weights = inputs()
        ref = run(exact, x, ids, weights, None)
        assert torch.equal(run(fixed, x, ids, weights, worst), ref)
        assert torch.equal(run(fixed, x, ids, weights, PairCapacity(4, False)), ref)
        assert fixed.overflow.pairs == tokens * top_k - 4 and fixed.overflow.exchanges == 1
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(fixed, x, ids, weights, worst)  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = run(fixed, x, ids, weights, worst)
        new_x, new_ids, new_weights = inputs()
        x.copy_(new_x)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(exact, new_x, new_ids, new_weights, None))
    finally:
        dist.destroy_process_group()
