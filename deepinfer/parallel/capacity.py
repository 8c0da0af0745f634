"""Fixed-capacity expert-parallel dispatch and combine (ops ``dispatch`` / ``combine``, backend
``torch_all_to_all_capacity``; chosen with ``kernels.dispatch``).

Every (source, destination) rank pair gets the same static number of rows, ``PairCapacity.rows``
(``moe.ExpertParallelMoE`` computes it alike on every rank from the forward's agreed token count). A
rank's (token, choice) pairs are sorted by destination rank (stable); pair i going to rank d at
position p among those for d lands in row ``d · rows + p`` of a zero-padded send buffer
``[world · rows, H]``, so the payload moves in ``all_to_all_single`` with equal splits: no split size
is exchanged or read on the host, and shapes depend only on ``rows`` — what a CUDA graph needs.
Padding rows carry zeros and local slot 0; they are computed like any row and their outputs are never
read back.

Overflow (pairs at position p ≥ rows) is not dropped: when ``PairCapacity.covers_worst_case`` is
False, the ranks agree on whether any of them overflowed (one all-reduce of a flag, read on the host:
a deliberate sync, once per layer, only in this mode), and if one did, the overflowing pairs of every
rank take a second, exact-split exchange (``dispatch.AllToAllBackend``, the oracle) whose rows are
appended to the received ones. ``overflow`` counts both. With the worst-case capacity (the default,
``parallel.dispatch_capacity_factor: null``) no pair can overflow and the check is skipped.

combine sends every received row's output back with the reverse equal-split all-to-all (and the
overflow rows with the exact one), and sums each token's choices like the exact path
(``dispatch.sum_choices``: float32, choice order), so both paths give the same numbers for the same
expert outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.interfaces import BackendCapabilities
from deepinfer.parallel.dispatch import AllToAllBackend, CommTimer, DispatchHandle, PairCapacity, sum_choices

_ALL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


@dataclass
class OverflowCounts:
    """Pairs past the per-pair capacity (this rank's, summed over calls), and the exact-split exchanges
    they took (dispatch calls in which some rank overflowed)."""

    pairs: int = 0
    exchanges: int = 0


@dataclass
class CapacityHandle:
    """What combine needs: the sort ``order`` of the ``T·k`` pairs, each sorted pair's ``send_row`` in
    the padded buffer (``world · rows`` for an overflowing pair: the discarded row), the overflow mask
    and the exact handle of their exchange (None when no rank overflowed), and the batch shape."""

    order: torch.Tensor
    send_row: torch.Tensor
    overflow: torch.Tensor
    exact: DispatchHandle | None
    fixed_rows: int
    num_tokens: int
    top_k: int
    group: dist.ProcessGroup | None


class CapacityAllToAllBackend:
    """Expert-parallel dispatch/combine with a fixed per-pair capacity (see the module docstring)."""

    name = "torch_all_to_all_capacity"
    # Below the exact path: ``auto`` keeps the oracle unless a run needs graph safety.
    priority = -1
    ops = frozenset({"dispatch", "combine"})
    # Static shapes and no host reads with the worst-case capacity; rows only move and the combine
    # sums in a fixed order: batch-invariant.
    capabilities = BackendCapabilities(dtypes=_ALL_DTYPES, graph_safe=True, batch_invariant=True)
    fixed_capacity = True  # asks its caller for a ``PairCapacity``

    def __init__(self) -> None:
        self.timer = CommTimer()
        self.overflow = OverflowCounts()
        self._exact = AllToAllBackend()

    def available(self) -> bool:
        return dist.is_available()

    def dispatch(self, x: torch.Tensor, dest_rank: torch.Tensor, dest_slot: torch.Tensor, *, world: int,
                 group: dist.ProcessGroup | None = None,
                 capacity: PairCapacity | None = None) -> tuple[torch.Tensor, torch.Tensor, CapacityHandle]:
        """``x [T, H]``; ``dest_rank``/``dest_slot [T, k]`` the rank and local slot of each choice;
        ``capacity`` the rows per rank pair (required, the same on every rank). Returns
        ``(x_recv [world·rows + M, H], slot_recv [world·rows + M] int64, handle)``: ``rows`` rows from
        each source rank in rank order (padding included), then the M overflow rows of the exact
        exchange (M = 0 when no rank overflowed)."""
        if capacity is None or capacity.rows < 1:
            raise ValueError(f"{self.name}: dispatch needs a PairCapacity with rows ≥ 1, got {capacity}")
        t0 = time.perf_counter()
        num_tokens, top_k = dest_rank.shape
        rows = capacity.rows
        fixed = world * rows
        flat_rank = dest_rank.reshape(-1)
        order = torch.argsort(flat_rank, stable=True)
        sorted_rank = flat_rank.index_select(0, order)
        # index_add_, not bincount: bincount on CUDA reads the maximum on the host
        counts = torch.zeros(world, dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat_rank, torch.ones_like(flat_rank))
        first = torch.cumsum(counts, 0) - counts  # each destination's first sorted pair
        position = torch.arange(flat_rank.numel(), device=x.device) - first.index_select(0, sorted_rank)
        overflow = position >= rows
        send_row = torch.where(overflow, torch.full_like(position, fixed), sorted_rank * rows + position)
        # One spare row takes every overflowing pair's write; it is never sent.
        send_x = x.new_zeros(fixed + 1, x.shape[1])
        send_x.index_copy_(0, send_row, x.index_select(0, order // top_k))
        send_slot = torch.zeros(fixed + 1, dtype=torch.int64, device=x.device)
        send_slot.index_copy_(0, send_row, dest_slot.reshape(-1).index_select(0, order).to(torch.int64))
        x_recv = x.new_empty(fixed, x.shape[1])
        dist.all_to_all_single(x_recv, send_x[:fixed], group=group)
        slot_recv = torch.empty(fixed, dtype=torch.int64, device=x.device)
        dist.all_to_all_single(slot_recv, send_slot[:fixed], group=group)
        exact = None
        if not capacity.covers_worst_case:
            local = overflow.sum().view(1)
            flag = local.clone()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if int(flag.item()) > 0:  # deliberate host read: do the ranks need the exact exchange?
                self.overflow.pairs += int(local.item())
                self.overflow.exchanges += 1
                over = order[overflow]
                x_over, slot_over, exact = self._exact.dispatch(
                    x.index_select(0, over // top_k), sorted_rank[overflow].view(-1, 1),
                    dest_slot.reshape(-1).index_select(0, over).view(-1, 1), world=world, group=group)
                x_recv = torch.cat([x_recv, x_over])
                slot_recv = torch.cat([slot_recv, slot_over])
        self.timer.dispatch_s += time.perf_counter() - t0
        self.timer.calls += 1
        handle = CapacityHandle(order, send_row, overflow, exact, fixed, num_tokens, top_k, group)
        return x_recv, slot_recv, handle

    def combine(self, y: torch.Tensor, handle: CapacityHandle, topk_weights: torch.Tensor) -> torch.Tensor:
        """``y`` the expert outputs (unweighted, in ``dispatch``'s receive order) → ``[T, H]`` in ``y``'s
        dtype: Σ over the k choices of weight · output, in float32, in choice order."""
        t0 = time.perf_counter()
        h = handle
        back = y.new_empty(h.fixed_rows + 1, y.shape[1])
        back[h.fixed_rows].zero_()
        dist.all_to_all_single(back[:h.fixed_rows], y[:h.fixed_rows].contiguous(), group=h.group)
        pairs = back.index_select(0, h.send_row)  # overflowing pairs read the spare row for now
        if h.exact is not None:
            ones = torch.ones(h.exact.num_tokens, 1, dtype=torch.float32, device=y.device)
            pairs[h.overflow] = self._exact.combine(y[h.fixed_rows:], h.exact, ones)
        out = sum_choices(pairs, h.order, topk_weights, h.num_tokens, h.top_k)
        self.timer.combine_s += time.perf_counter() - t0
        return out
