"""``greedy_multistep``: the reference system's placement (reference/deepinfer.md §7,
``rebalance_experts_global``), which optimizes the sum over history steps of the busiest rank's
load rather than the load of the summed history — a step is as slow as its busiest rank, so two
experts that are hot at different steps can share a rank.

Inputs are one layer's loads ``T [steps, logical]`` (tokens routed to each logical expert at each
step). A replica of expert e carries ``T[:, e] / count[e]`` per step (tokens are spread evenly over
replicas).

1. *Replication*: start with one replica each; give each redundant slot to the expert whose extra
   replica most lowers Σ_step max_expert per-replica load (first index on ties). Only an expert that
   is the per-step maximum can lower that step's maximum, so the gain of j is the sum, over the steps
   where j is the argmax, of ``max - max(second, T[s, j] / (count[j] + 1))``. A tiny tie-breaker
   (``1e-4 · index``) added to per-replica loads keeps the maxima distinct, as the reference does.
2. *Placement*: replicas by descending total load (stable); each goes to the rank with a free slot
   that minimizes ``Σ_step max(peak[step], load[rank, step] + v[step])``, where ``peak`` is the current
   busiest-rank load at each step (lowest rank on ties). A rank's slots fill in assignment order.
"""

from __future__ import annotations

import torch

TIE_BREAK = 1e-4


def replicate_multistep(load: torch.Tensor, num_physical: int) -> torch.Tensor:
    """Replica counts ``[logical]`` (int64, sum ``num_physical``) for ``load [steps, logical]``."""
    num_logical = load.shape[1]
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} logical experts")
    counts = torch.ones(num_logical, dtype=torch.int64)
    if num_logical == 1:
        counts[0] = num_physical
        return counts
    t = load.double()
    tie = TIE_BREAK * torch.arange(num_logical, dtype=torch.float64)
    for _ in range(num_physical - num_logical):
        per_replica = t / counts + tie  # [S, E]
        top = per_replica.topk(2, dim=1)
        first, second, hot = top.values[:, 0], top.values[:, 1], top.indices[:, 0]
        lowered = torch.maximum(second, t.gather(1, hot[:, None])[:, 0] / (counts[hot] + 1) + tie[hot])
        gain = torch.zeros(num_logical, dtype=torch.float64).scatter_add_(0, hot, first - lowered)
        # Σ_s max after the extra replica = Σ_s first − gain[j]; the smallest sum is the largest gain.
        counts[int(torch.argmax(gain))] += 1
    return counts


def pack_multistep(load: torch.Tensor, counts: torch.Tensor, ranks: int, slots_per_rank: int) -> torch.Tensor:
    """``phys_to_logical [ranks · slots_per_rank]`` placing ``counts[e]`` replicas of each expert."""
    steps, num_logical = load.shape
    if int(counts.sum()) != ranks * slots_per_rank:
        raise ValueError(f"{int(counts.sum())} replicas for {ranks} × {slots_per_rank} slots")
    per_replica = load.double() / counts.clamp(min=1)  # [S, E]: one replica's load per step
    experts = torch.repeat_interleave(torch.arange(num_logical), counts)
    totals = per_replica.sum(dim=0)[experts]
    order = torch.argsort(totals, descending=True, stable=True)
    rank_load = torch.zeros(ranks, steps, dtype=torch.float64)
    peak = torch.zeros(steps, dtype=torch.float64)
    filled = [0] * ranks
    placed: list[list[int]] = [[] for _ in range(ranks)]
    full_cost = torch.tensor(float("inf"), dtype=torch.float64)
    for e in experts[order].tolist():
        v = per_replica[:, e]
        cost = torch.maximum(peak, rank_load + v).sum(dim=1)  # [R]
        cost = torch.where(torch.tensor([f >= slots_per_rank for f in filled]), full_cost, cost)
        r = int(torch.argmin(cost))
        rank_load[r] += v
        peak = torch.maximum(peak, rank_load[r])
        filled[r] += 1
        placed[r].append(e)
    return torch.tensor([e for row in placed for e in row], dtype=torch.int64)


def place_layer_multistep(load: torch.Tensor, ranks: int, slots_per_rank: int) -> torch.Tensor:
    """One layer: replication then placement; ``load [steps, logical]`` → ``[ranks · slots_per_rank]``."""
    if load.shape[0] == 0:
        load = torch.zeros(1, load.shape[1])
    counts = replicate_multistep(load, ranks * slots_per_rank)
    return pack_multistep(load, counts, ranks, slots_per_rank)
