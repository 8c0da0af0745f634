"""The weight shuffle: make one rank's expert slots match a new placement (reference/deepinfer.md §7).

Every rank computes the same move plan (``placement.plan_moves``). Per layer, a rank builds its new
slot tensors: slots that keep their expert are copied in place, in-rank moves copy from the old
local slot (no traffic), and the rest arrive by point-to-point messages — one message per (sender,
receiver) pair and layer, the slots' ``w13`` and ``w2`` rows packed back to back in plan order,
posted together with ``dist.batch_isend_irecv`` (NCCL or gloo). The old tensors stay intact until
every message of the layer is done, so a rank can send an expert it is about to overwrite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.parallel.moe import ExpertParallelMoE
from deepinfer.parallel.placement import Move, align_to_previous, plan_moves


@dataclass
class ShuffleReport:
    """What one rank did in a shuffle: experts copied inside the rank, sent and received."""

    local_copies: int = 0
    sent: int = 0
    received: int = 0
    bytes_sent: int = 0


def _pack(ep: ExpertParallelMoE, slots: list[int]) -> torch.Tensor:
    index = torch.tensor(slots, dtype=torch.int64, device=ep.device)
    return torch.cat([ep.w13.index_select(0, index).reshape(len(slots), -1),
                      ep.w2.index_select(0, index).reshape(len(slots), -1)], dim=1)


def shuffle_layer(ep: ExpertParallelMoE, new_row: torch.Tensor, report: ShuffleReport) -> torch.Tensor:
    """Move weights so ``ep`` holds ``new_row [ranks·slots]`` (aligned first, see
    ``align_to_previous``); installs and returns the aligned row. Collective over ``ep.group``."""
    slots, me = ep.slots, ep.rank
    old_row = ep.phys_to_logical
    new_row = align_to_previous(old_row, new_row.to("cpu", torch.int64), slots)
    moves = plan_moves(old_row, new_row, slots)
    new_w13, new_w2 = ep.w13.clone(), ep.w2.clone()  # unchanged slots keep their weights
    outgoing: dict[int, list[Move]] = {}
    incoming: dict[int, list[Move]] = {}
    for m in moves:
        if m.is_local and m.dst_rank == me:
            new_w13[m.dst_slot].copy_(ep.w13[m.src_slot])
            new_w2[m.dst_slot].copy_(ep.w2[m.src_slot])
            report.local_copies += 1
        elif not m.is_local and m.src_rank == me:
            outgoing.setdefault(m.dst_rank, []).append(m)
        elif not m.is_local and m.dst_rank == me:
            incoming.setdefault(m.src_rank, []).append(m)
    ops, buffers = [], []
    for peer in sorted(set(outgoing) | set(incoming)):
        if peer in outgoing:
            packed = _pack(ep, [m.src_slot for m in outgoing[peer]])
            ops.append(dist.P2POp(dist.isend, packed, peer, group=ep.group))
            report.sent += len(outgoing[peer])
            report.bytes_sent += packed.numel() * packed.element_size()
            buffers.append(packed)  # keep alive until the send completes
        if peer in incoming:
            width = ep.w13[0].numel() + ep.w2[0].numel()
            recv = torch.empty(len(incoming[peer]), width, dtype=ep.w13.dtype, device=ep.device)
            ops.append(dist.P2POp(dist.irecv, recv, peer, group=ep.group))
            buffers.append((peer, recv))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    split = ep.w13[0].numel()
    for item in buffers:
        if not isinstance(item, tuple):
            continue
        peer, recv = item
        for row, m in zip(recv, incoming[peer], strict=True):
            new_w13[m.dst_slot].copy_(row[:split].view_as(new_w13[m.dst_slot]))
            new_w2[m.dst_slot].copy_(row[split:].view_as(new_w2[m.dst_slot]))
            report.received += 1
    ep.w13.copy_(new_w13)  # into the buffers they had: a captured graph reads the new weights
    ep.w2.copy_(new_w2)
    ep.set_placement(new_row)
    return new_row
