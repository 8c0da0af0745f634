"""The core's expert-parallel dispatch and combine over ``torch.distributed`` all-to-all (ops
``dispatch`` / ``combine``; the reference that DeepEP-style backends replace, API.md §2).

dispatch: every (token, choice) pair goes to the rank that holds its physical expert slot. Pairs are
sorted by destination rank (stable, so a token's choices keep their order), the per-rank counts are
exchanged first (one all-to-all of ``world`` integers, read on the host: the split sizes must be
known before the payload moves — a deliberate sync), then the token rows and their local slot ids
move in two all-to-alls. A token that picks two experts of one rank is sent twice; deduplication is a
kernel backend's job.

combine: each expert output row goes back to the rank and position it came from (the reverse
all-to-all), and the token's output is ``Σ_j topk_weights[t, j] · y[t, j]`` accumulated in float32
in the fixed order j = 0, 1, …, k−1, so the result does not depend on which rank answered first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.interfaces import BackendCapabilities

_ALL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


@dataclass(frozen=True)
class PairCapacity:
    """What a fixed-capacity dispatch may send each destination rank: ``rows`` per (source, destination)
    pair, and ``covers_worst_case`` — True when ``rows`` is at least the most pairs any rank can send one
    destination in this forward, so that no pair can overflow and no rank needs to check. The caller
    (``moe.ExpertParallelMoE``) computes it alike on every rank; exact-split backends ignore it."""

    rows: int
    covers_worst_case: bool


@dataclass
class DispatchHandle:
    """What combine needs to send outputs home: the sort ``order`` of the ``T·k`` pairs, the counts
    sent to (``send_counts``) and received from (``recv_counts``) every rank, and the batch shape."""

    order: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    top_k: int
    group: dist.ProcessGroup | None


@dataclass
class CommTimer:
    """Seconds spent in dispatch and combine (host wall time; on CUDA it includes the wait for the
    collectives because the split-size exchange synchronizes)."""

    dispatch_s: float = 0.0
    combine_s: float = 0.0
    calls: int = 0


class AllToAllBackend:
    """Expert-parallel dispatch/combine through ``dist.all_to_all_single`` (gloo on CPU, NCCL on CUDA)."""

    name = "torch_all_to_all"
    priority = 0
    ops = frozenset({"dispatch", "combine"})
    # Rows only move, and the combine sums each token's choices in a fixed order: batch-invariant.
    capabilities = BackendCapabilities(dtypes=_ALL_DTYPES, graph_safe=False, batch_invariant=True)

    def __init__(self) -> None:
        self.timer = CommTimer()

    def available(self) -> bool:
        return dist.is_available()

    def dispatch(self, x: torch.Tensor, dest_rank: torch.Tensor, dest_slot: torch.Tensor, *, world: int,
                 group: dist.ProcessGroup | None = None,
                 capacity: PairCapacity | None = None) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """``x [T, H]``; ``dest_rank``/``dest_slot [T, k]`` the rank and local slot of each choice.
        Returns ``(x_recv [M, H], slot_recv [M] int64, handle)``: the rows this rank must compute,
        grouped by source rank, with the local slot of each. ``capacity`` is ignored (the split sizes
        are exact)."""
        t0 = time.perf_counter()
        num_tokens, top_k = dest_rank.shape
        flat_rank = dest_rank.reshape(-1)
        order = torch.argsort(flat_rank, stable=True)
        send = torch.bincount(flat_rank, minlength=world).to(torch.int64)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        both = torch.stack([send, recv]).tolist()  # the split sizes must be on the host: one deliberate read
        send_counts, recv_counts = both[0], both[1]
        rows = x.index_select(0, order // top_k)
        x_recv = x.new_empty(sum(recv_counts), x.shape[1])
        dist.all_to_all_single(x_recv, rows, recv_counts, send_counts, group=group)
        slots = dest_slot.reshape(-1).index_select(0, order).to(torch.int64)
        slot_recv = torch.empty(sum(recv_counts), dtype=torch.int64, device=x.device)
        dist.all_to_all_single(slot_recv, slots, recv_counts, send_counts, group=group)
        self.timer.dispatch_s += time.perf_counter() - t0
        self.timer.calls += 1
        return x_recv, slot_recv, DispatchHandle(order, send_counts, recv_counts, num_tokens, top_k, group)

    def combine(self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor) -> torch.Tensor:
        """``y [M, H]`` expert outputs (unweighted, in ``dispatch``'s receive order) → ``[T, H]`` in
        ``y``'s dtype: Σ over the k choices of weight · output, in float32, in choice order."""
        t0 = time.perf_counter()
        h = handle
        back = y.new_empty(sum(h.send_counts), y.shape[1])
        dist.all_to_all_single(back, y.contiguous(), h.send_counts, h.recv_counts, group=h.group)
        out = sum_choices(back, h.order, topk_weights, h.num_tokens, h.top_k)
        self.timer.combine_s += time.perf_counter() - t0
        return out


def sum_choices(rows: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int,
                top_k: int) -> torch.Tensor:
    """``rows [T·k, H]``, the expert output of each (token, choice) pair in sorted ``order`` (``rows[i]``
    answers pair ``order[i]``) → ``[T, H]`` in ``rows``' dtype: Σ_j ``topk_weights[t, j]`` · output, in
    float32, in the fixed order j = 0, 1, …, k−1 whatever the ranks did."""
    per_choice = torch.empty_like(rows)
    per_choice[order] = rows
    per_choice = per_choice.view(num_tokens, top_k, rows.shape[1]).float()  # not -1: T may be 0
    weights = topk_weights.float()
    out = per_choice[:, 0] * weights[:, 0:1]
    for j in range(1, top_k):
        out = out + per_choice[:, j] * weights[:, j:j + 1]
    return out.to(rows.dtype)
