"""The core's expert-parallel mechanisms without rank processes: placements as data (replica maps,
replica routing, move plans, balance), the routers and size checks, and the whole EP path — dispatch,
local experts, combine, rebalance with weight moves, statistics — on a process group of one rank
(gloo here; the same test runs on NCCL in tests/test_gpu_parallel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tiny_deepseek import save_tiny_v3

from deepinfer import LLM, SamplingParams
from deepinfer.config import ParallelSection
from deepinfer.defaults import LeastLoadedRouter, RoundRobinRouter
from deepinfer.engine.engine import LLMEngine
from deepinfer.errors import ConfigError
from deepinfer.interfaces import RankLoad, Topology
from deepinfer.parallel.balancer import ExpertBalancer
from deepinfer.parallel.moe import ExpertParallelMoE, attach_expert_parallel, ep_capable_layers
from deepinfer.parallel.placement import (
    align_to_previous,
    balancedness,
    initial_placement,
    logical_to_physical,
    num_physical_experts,
    plan_moves,
    rank_loads,
    replica_counts,
    route_to_replicas,
    validate_placement,
)
from deepinfer.parallel.sizes import parallel_sizes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_sizes_and_initial_placement():
    assert num_physical_experts(8, 0, 2) == 8
    assert num_physical_experts(8, 1, 4) == 12  # rounded up so every rank holds 3
    assert initial_placement(2, 5, 8).tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]] * 2


def test_replica_maps():
    p2l = torch.tensor([[0, 1, 2, 3, 0, 1], [3, 3, 2, 1, 0, 3]])
    assert replica_counts(p2l, 4).tolist() == [[2, 2, 1, 1], [1, 1, 1, 3]]
    l2p = logical_to_physical(p2l, 4)
    assert l2p[0].tolist() == [[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]]
    assert l2p[1].tolist() == [[4, -1, -1], [3, -1, -1], [2, -1, -1], [0, 1, 5]]


def test_validate_placement_names_the_policy():
    with pytest.raises(ValueError, match=r"policy 'x'.*expert 3 of MoE layer 0"):
        validate_placement(torch.tensor([[0, 1, 2, 2]]), 1, 4, 4, "policy 'x'")
    with pytest.raises(ValueError, match="shape"):
        validate_placement(torch.zeros(2, 4, dtype=torch.int64), 1, 4, 4, "policy 'x'")
    with pytest.raises(ValueError, match="outside"):
        validate_placement(torch.tensor([[0, 1, 2, 9]]), 1, 4, 4, "policy 'x'")


def test_route_to_replicas_spreads_tokens_deterministically():
    p2l = torch.tensor([[0, 1, 2, 0, 0, 3]])
    l2p, counts = logical_to_physical(p2l, 4)[0], replica_counts(p2l, 4)[0]
    ids = torch.zeros(300, 1, dtype=torch.int64)  # every token picks expert 0 (slots 0, 3, 4)
    slots = route_to_replicas(ids, l2p, counts, rank=1)
    assert set(slots.view(-1).tolist()) == {0, 3, 4}
    assert torch.bincount(slots.view(-1), minlength=5)[[0, 3, 4]].tolist() == [100, 100, 100]
    assert torch.equal(slots, route_to_replicas(ids, l2p, counts, rank=1))
    assert not torch.equal(slots, route_to_replicas(ids, l2p, counts, rank=0))  # ranks start elsewhere
    single = route_to_replicas(torch.tensor([[1, 3]]), l2p, counts, rank=0)
    assert single.tolist() == [[1, 5]]


def _apply(moves, old: torch.Tensor, slots: int) -> torch.Tensor:
    """Simulate a move plan on a placement: destination slots take the source slot's old expert."""
    out = old.clone()
    for m in moves:
        out[m.dst_rank * slots + m.dst_slot] = old[m.src_rank * slots + m.src_slot]
    return out


def test_move_plans_reach_the_new_placement_with_in_rank_copies_first():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        ranks, slots, experts = 4, 3, 9
        old = torch.cat([torch.arange(experts), torch.randint(0, experts, (ranks * slots - experts,), generator=gen)])
        new = torch.cat([torch.randperm(experts, generator=gen),
                         torch.randint(0, experts, (ranks * slots - experts,), generator=gen)])
        new = align_to_previous(old, new, slots)
        moves = plan_moves(old, new, slots)
        assert torch.equal(_apply(moves, old, slots), new)
        local = [m.is_local for m in moves]
        assert local == sorted(local, reverse=True)  # every in-rank copy comes before any transfer
        for m in moves:
            assert old[m.src_rank * slots + m.src_slot] == m.expert
            if not m.is_local:  # a transfer only when the receiving rank did not hold the expert
                assert m.expert not in old[m.dst_rank * slots:(m.dst_rank + 1) * slots].tolist()


def test_receivers_are_spread_over_senders():
    # expert 0 held by ranks 0 and 1; ranks 2..6 need it: 5 receivers over 2 senders →
    # ⌊5/2⌋ = 2 contiguous receivers each, then the last one round-robin from the first sender.
    old = torch.tensor([0, 0, 1, 2, 3, 4, 5])
    new = torch.tensor([0, 0, 0, 0, 0, 0, 0])
    moves = plan_moves(old, new, 1)
    assert [(m.src_rank, m.dst_rank) for m in moves] == [(0, 2), (0, 3), (1, 4), (1, 5), (0, 6)]


def test_align_keeps_experts_that_stay_in_their_slot():
    old = torch.tensor([0, 1, 2, 3, 4, 5])
    new = torch.tensor([2, 0, 4, 5, 3, 1])  # ranks swap experts 1 and 4; the rest only reorder
    aligned = align_to_previous(old, new, 3)
    assert aligned.tolist() == [0, 4, 2, 3, 1, 5]
    moves = plan_moves(old, aligned, 3)
    assert [(m.expert, m.src_rank, m.dst_rank, m.dst_slot) for m in moves] == [(1, 0, 1, 1), (4, 1, 0, 1)]
    with pytest.raises(ValueError, match="expert 7"):
        plan_moves(old, torch.tensor([7, 1, 2, 3, 4, 5]), 3)


def test_rank_loads_and_balancedness():
    load = torch.tensor([[[8.0, 2.0, 2.0, 0.0]]])  # one step, one layer
    even = torch.tensor([[0, 3, 1, 2]])  # ranks {0, 3} {1, 2}: 8 vs 4
    assert rank_loads(load, even, 2).tolist() == [[[8.0, 4.0]]]
    assert balancedness(rank_loads(load, even, 2)) == pytest.approx(6 / 8)
    replicated = torch.tensor([[0, 1, 0, 2]])  # expert 0 on both ranks: 4 + 2 each
    assert balancedness(rank_loads(load, replicated, 2)) == 1.0
    assert balancedness(torch.zeros(3, 2, 4)) == 1.0


def test_routers_and_size_checks():
    loads = [RankLoad(0, 2, 90), RankLoad(1, 5, 40), RankLoad(2, 1, 40)]
    assert LeastLoadedRouter().route(None, loads) == 2  # fewest tokens, then fewest requests
    rr = RoundRobinRouter()
    assert [rr.route(None, loads) for _ in range(4)] == [0, 1, 2, 0]
    assert parallel_sizes(ParallelSection(expert_parallel_size=4)) == (4, 4)
    assert parallel_sizes(ParallelSection(data_parallel_size=2)) == (2, 1)
    with pytest.raises(ConfigError, match="must equal"):
        parallel_sizes(ParallelSection(data_parallel_size=2, expert_parallel_size=4))


def test_a_single_process_engine_refuses_several_ranks(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"started by deepinfer\.LLM only"):
        LLMEngine(str(tiny_llama_dir), overrides={"parallel": {"expert_parallel_size": 2}})


# ---------------------------------------------------------------------------------- a world of one rank


class ReversePolicy:
    """Slot p holds expert (E − 1 − p) mod E on every layer (so the redundant replicas go to the last
    experts instead of the first); rebalances when asked."""

    num_redundant_experts = 2
    window = 4

    def due(self, step: int) -> bool:
        return False

    def place(self, load: torch.Tensor, topology: Topology) -> torch.Tensor:
        physical = topology.ranks * topology.slots_per_rank
        experts = load.shape[2]
        row = (experts - 1 - torch.arange(physical)) % experts
        return row.unsqueeze(0).repeat(load.shape[1], 1)


def _one_rank_expert_parallel(llm: LLM, policy: ReversePolicy, num_layers: int,
                              experts: int) -> tuple[list[ExpertParallelMoE], ExpertBalancer]:
    """Expert parallelism on ``llm``'s model over the process group of one rank (initialized), balanced by
    ``policy``."""
    physical = num_physical_experts(experts, policy.num_redundant_experts, 1)
    layers = attach_expert_parallel(llm.engine.model, rank=0, world=1, slots=physical,
                                    placement=initial_placement(num_layers, experts, physical), group=None)
    balancer = ExpertBalancer(layers, policy=policy, policy_name="reverse",
                              topology=Topology(ranks=1, slots_per_rank=physical), group=None, device=llm.engine.device)
    return layers, balancer


def world_of_one_rank_roundtrip(folder: Path, device: str, backend: str, dtype: str = "float32") -> None:
    """EP over a process group of one rank gives the plain engine's greedy tokens, before and after a
    rebalance that moves every expert to another slot; each slot then holds the right weights."""
    kw = {"kv_cache_bytes": 1 << 22, "block_size": 16, "device": device, "dtype": dtype}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (4, 33, 9, 20)]
    reference = LLM(folder, **kw)
    ref_tokens = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    ref_layers = ep_capable_layers(reference.engine.model)
    llm = LLM(folder, **kw)
    model = llm.engine.model
    experts = ref_layers[0].w13.shape[0]
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        layers, balancer = _one_rank_expert_parallel(llm, ReversePolicy(), len(ref_layers), experts)
        assert all(layer.mlp.w13 is None for layer in model.layers if layer.is_moe)  # full stacks dropped
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref_tokens
        for _ in range(3):
            balancer.end_step()
        balancer.rebalance()
        for ep, ref in zip(layers, ref_layers, strict=True):
            # one rank: the policy's multiset of experts, aligned so that kept experts stay in place
            # (only the two redundant slots change: experts 0 and 1 make way for 7 and 6)
            assert ep.local_experts == [*range(experts), experts - 1, experts - 2]
            for slot, e in enumerate(ep.local_experts):
                assert torch.equal(ep.w13[slot], ref.w13.data[e]) and torch.equal(ep.w2[slot], ref.w2.data[e])
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref_tokens
        stats = balancer.stats()
        assert stats["rebalances"] == 1 and stats["balancedness"] == 1.0  # one rank is always balanced
        assert stats["experts_sent"] == 0 and stats["experts_copied_in_rank"] == 2 * len(layers)
    finally:
        dist.destroy_process_group()
        llm.shutdown()
        reference.shutdown()


@pytest.fixture(scope="module")
def tiny_v3_dir(tmp_path_factory) -> Path:
    return save_tiny_v3(tmp_path_factory.mktemp("tiny-v3-one-rank"))


def test_expert_parallel_path_on_a_world_of_one_rank_gloo(tiny_v3_dir):
    world_of_one_rank_roundtrip(tiny_v3_dir, "cpu", "gloo")


class ReverseWhenStepThreeEnds(ReversePolicy):
    def due(self, step: int) -> bool:
        return step == 3


def test_a_due_rebalance_moves_one_layer_per_step_into_the_same_buffers(tiny_v3_dir):
    """Staged rebalancing: the policy's placement reaches layer 0 after the step it was due, layer 1 after
    the next; weights and routing maps change inside the buffers they had (what captured graphs read), and
    a generation while only layer 0 has moved gives the plain engine's tokens."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 31, 7], list(range(3, 40))]
    llm = LLM(tiny_v3_dir, kv_cache_bytes=1 << 22, block_size=16)
    ref_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    model = llm.engine.model
    full = [(layer.w13.data.clone(), layer.w2.data.clone()) for layer in ep_capable_layers(model)]
    experts = full[0][0].shape[0]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layers, balancer = _one_rank_expert_parallel(llm, ReverseWhenStepThreeEnds(), len(full), experts)
        buffers = [(ep.w13.data_ptr(), ep.w2.data_ptr(), ep.l2p.data_ptr(), ep.counts.data_ptr()) for ep in layers]
        placed = [*range(experts), experts - 1, experts - 2]  # the policy's, aligned to the old slots
        moved_after_step = []
        for step in range(1, 6):
            balancer.end_step()
            moved_after_step.append([ep.local_experts == placed for ep in layers])
            if step == 3:
                assert balancer.stats()["layers_to_move"] == 1
                assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref_tokens
        assert moved_after_step == [[False, False], [False, False], [True, False], [True, True], [True, True]]
        assert [(ep.w13.data_ptr(), ep.w2.data_ptr(), ep.l2p.data_ptr(), ep.counts.data_ptr())
                for ep in layers] == buffers
        for ep, (w13, w2) in zip(layers, full, strict=True):
            for slot, e in enumerate(ep.local_experts):
                assert torch.equal(ep.w13[slot], w13[e]) and torch.equal(ep.w2[slot], w2[e])
        stats = balancer.stats()
        assert stats["rebalances"] == 1 and stats["layers_to_move"] == 0
        assert stats["experts_copied_in_rank"] == 2 * len(layers)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref_tokens
    finally:
        dist.destroy_process_group()
        llm.shutdown()
