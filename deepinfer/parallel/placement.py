"""Expert placement as data: which logical expert each physical slot holds, and what follows from it.

A *placement* of one MoE layer is ``phys_to_logical [ranks · slots_per_rank]``: physical slot ``p``
lives on rank ``p // slots_per_rank`` and holds the weights of logical expert ``phys_to_logical[p]``.
Every logical expert has at least one replica. From it follow the ``logical_to_physical`` map used by
routing (``[logical, max_replicas]``, −1 padded) and the replica counts.

Everything here is pure and deterministic (no communication): every rank computes the same answer
from the same inputs, which is what keeps ranks in agreement without extra messages. Facts from
``reference/deepinfer.md §7``: the sizes, the initial placement, replica selection
``dup = (rank + token_index · 23333) mod count``, and the weight-shuffle plan (in-rank moves first;
receivers spread over the ranks that held the expert before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REPLICA_HASH = 23333  # reference/deepinfer.md §7: spreads one rank's tokens over an expert's replicas


def num_physical_experts(num_logical: int, num_redundant: int, world: int) -> int:
    """Physical slots: logical + redundant, rounded up so every rank holds the same number."""
    if num_logical < 1 or num_redundant < 0 or world < 1:
        raise ValueError(f"need num_logical ≥ 1, num_redundant ≥ 0, world ≥ 1 (got {num_logical}, "
                         f"{num_redundant}, {world})")
    total = num_logical + num_redundant
    return -(-total // world) * world


def initial_placement(num_layers: int, num_logical: int, num_physical: int) -> torch.Tensor:
    """``[layers, physical]``: slot s holds logical s, then the extra slots hold ``s mod logical``."""
    row = torch.arange(num_physical, dtype=torch.int64) % num_logical
    return row.unsqueeze(0).repeat(num_layers, 1)


@dataclass(frozen=True)
class ExpertShard:
    """Which routed experts one rank loads: the local slots of ``initial_placement`` for rank ``rank`` of
    ``world`` with ``num_redundant`` redundant experts (the same for every MoE layer). Models built with
    one (the ``deepinfer_expert_shard`` key of their config, set by the engine inside a rank process)
    allocate only these rows of their expert stacks, and the loader reads only these experts."""

    rank: int
    world: int
    num_redundant: int

    def slots(self, num_logical: int) -> int:
        """Physical slots per rank."""
        return num_physical_experts(num_logical, self.num_redundant, self.world) // self.world

    def experts(self, num_logical: int) -> list[int]:
        """The logical expert of each local slot, as ``initial_placement`` puts them."""
        slots = self.slots(num_logical)
        row = initial_placement(1, num_logical, slots * self.world)[0]
        return row[self.rank * slots:(self.rank + 1) * slots].tolist()


def validate_placement(phys_to_logical: torch.Tensor, num_layers: int, num_logical: int, num_physical: int,
                       source: str) -> torch.Tensor:
    """Check a policy's answer and return it as int64 on the CPU; raise ``ValueError`` naming ``source``."""
    p2l = torch.as_tensor(phys_to_logical)
    if tuple(p2l.shape) != (num_layers, num_physical):
        raise ValueError(f"{source} returned a placement of shape {tuple(p2l.shape)}; expected "
                         f"[layers={num_layers}, physical slots={num_physical}]")
    if p2l.dtype.is_floating_point or p2l.dtype == torch.bool:
        raise ValueError(f"{source} returned a {p2l.dtype} placement; expected integer expert ids")
    p2l = p2l.to(device="cpu", dtype=torch.int64)
    if int(p2l.min()) < 0 or int(p2l.max()) >= num_logical:
        raise ValueError(f"{source} returned expert ids outside [0, {num_logical})")
    counts = replica_counts(p2l, num_logical)
    if int(counts.min()) < 1:
        layer, expert = divmod(int(torch.argmin(counts)), num_logical)
        raise ValueError(f"{source} left logical expert {expert} of MoE layer {layer} without a replica")
    return p2l


def replica_counts(phys_to_logical: torch.Tensor, num_logical: int) -> torch.Tensor:
    """``[layers, logical]`` replicas per logical expert."""
    layers = phys_to_logical.shape[0]
    counts = torch.zeros(layers, num_logical, dtype=torch.int64, device=phys_to_logical.device)
    return counts.scatter_add_(1, phys_to_logical, torch.ones_like(phys_to_logical))


def logical_to_physical(phys_to_logical: torch.Tensor, num_logical: int) -> torch.Tensor:
    """``[layers, logical, max_replicas]`` physical slots of each logical expert in ascending order,
    −1 padded."""
    layers, physical = phys_to_logical.shape
    counts = replica_counts(phys_to_logical, num_logical)
    width = int(counts.max())
    out = torch.full((layers, num_logical, width), -1, dtype=torch.int64)
    # Sorting (expert, slot) pairs puts each expert's slots together in ascending slot order; the
    # rank of a slot within its expert's run is its replica index.
    key = phys_to_logical.cpu() * physical + torch.arange(physical)
    order = key.sort(dim=1).indices
    experts = phys_to_logical.cpu().gather(1, order)
    starts = torch.cumsum(counts.cpu(), dim=1) - counts.cpu()
    index = torch.arange(physical).unsqueeze(0) - starts.gather(1, experts)
    layer_ids = torch.arange(layers).unsqueeze(1).expand(-1, physical)
    out[layer_ids, experts, index] = order
    return out


def rank_loads(load: torch.Tensor, phys_to_logical: torch.Tensor, ranks: int) -> torch.Tensor:
    """Expected tokens per rank ``[steps, layers, ranks]`` for ``load [steps, layers, logical]`` when
    each expert's tokens are spread evenly over its replicas (what the replica hash does on average)."""
    num_logical = load.shape[-1]
    counts = replica_counts(phys_to_logical, num_logical).to(load.device)
    per_replica = load.double() / counts.double()  # [S, L, E]
    per_slot = per_replica.gather(2, phys_to_logical.to(load.device).unsqueeze(0).expand(load.shape[0], -1, -1))
    return per_slot.unflatten(2, (ranks, -1)).sum(dim=-1)


def balancedness(per_rank: torch.Tensor) -> float:
    """Mean over max rank load, summed over steps and layers first (1.0 = perfectly even;
    ``per_rank [..., ranks]``); 1.0 when nothing was routed."""
    peak = per_rank.double().amax(dim=-1).sum()
    return float(per_rank.double().mean(dim=-1).sum() / peak) if float(peak) > 0 else 1.0


def align_to_previous(old: torch.Tensor, new: torch.Tensor, slots_per_rank: int) -> torch.Tensor:
    """Permute ``new [physical]`` within each rank so that an expert that stays on a rank keeps its
    slot; the set of experts per rank (the policy's decision) is unchanged, fewer weights move."""
    out = new.clone()
    for start in range(0, new.numel(), slots_per_rank):
        before = old[start:start + slots_per_rank].tolist()
        wanted = new[start:start + slots_per_rank].tolist()
        row: list[int | None] = [None] * slots_per_rank
        rest: list[int] = []
        for e in wanted:
            # keep e where it already is if that slot is still free and held e before
            spot = next((i for i, b in enumerate(before) if b == e and row[i] is None), None)
            if spot is None:
                rest.append(e)
            else:
                row[spot] = e
        free = iter(i for i, v in enumerate(row) if v is None)
        for e in rest:
            row[next(free)] = e
        out[start:start + slots_per_rank] = torch.tensor(row, dtype=out.dtype)
    return out


@dataclass(frozen=True)
class Move:
    """Copy the weights of logical ``expert`` from ``src_rank``'s ``src_slot`` (old placement) into
    ``dst_rank``'s ``dst_slot`` (new placement); slots are local indices on their rank."""

    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


def plan_moves(old: torch.Tensor, new: torch.Tensor, slots_per_rank: int) -> list[Move]:
    """The weight moves that turn placement ``old [physical]`` into ``new [physical]`` for one layer.

    A slot that already holds its expert needs nothing. Otherwise the expert is copied inside the rank
    when the rank held it before (in-rank moves come first, no traffic). The remaining receivers of an
    expert are spread over the ranks that held it: with R receivers and S senders, the first
    ⌊R/S⌋·S receivers go in contiguous groups of ⌊R/S⌋ to each sender, the rest round-robin
    (reference/deepinfer.md §7). Deterministic: every rank computes the same list.
    """
    ranks = new.numel() // slots_per_rank
    old_rows = old.view(ranks, slots_per_rank).tolist()
    new_rows = new.view(ranks, slots_per_rank).tolist()
    local: list[Move] = []
    remote_needs: dict[int, list[tuple[int, int]]] = {}
    for r in range(ranks):
        for s, e in enumerate(new_rows[r]):
            if old_rows[r][s] == e:
                continue
            if e in old_rows[r]:
                local.append(Move(e, r, old_rows[r].index(e), r, s))
            else:
                remote_needs.setdefault(e, []).append((r, s))
    remote: list[Move] = []
    for e in sorted(remote_needs):
        receivers = remote_needs[e]
        senders = [(r, row.index(e)) for r, row in enumerate(old_rows) if e in row]
        if not senders:
            raise ValueError(f"no rank holds logical expert {e} in the old placement")
        per_sender = len(receivers) // len(senders)
        for i, (dst_rank, dst_slot) in enumerate(receivers):
            if i < per_sender * len(senders):
                src_rank, src_slot = senders[i // per_sender]
            else:
                src_rank, src_slot = senders[(i - per_sender * len(senders)) % len(senders)]
            remote.append(Move(e, src_rank, src_slot, dst_rank, dst_slot))
    return local + remote


def route_to_replicas(topk_ids: torch.Tensor, logical_to_phys: torch.Tensor, counts: torch.Tensor,
                      rank: int) -> torch.Tensor:
    """Physical slots ``[T, k]`` for logical ``topk_ids [T, k]``: replica
    ``(rank + token_index · 23333) mod count[e]`` of expert e, so each rank spreads its tokens over an
    expert's replicas deterministically and different ranks start at different replicas."""
    tokens = torch.arange(topk_ids.shape[0], device=topk_ids.device, dtype=torch.int64).unsqueeze(1)
    dup = (rank + tokens * REPLICA_HASH) % counts[topk_ids]
    return logical_to_phys[topk_ids, dup]
