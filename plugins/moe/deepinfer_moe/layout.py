"""Token layouts for grouped expert GEMMs, built on the device without a host sync.

A routed MoE step has ``P = T·k`` (token, expert) pairs; pair ``p`` is token ``p // k``'s ``p % k``-th
choice, ``topk_ids.reshape(-1)[p]``. Kernels want the pairs of one expert side by side so that an
expert's weights are read once per tile of rows. Every layout here has a shape that depends only on
``(T, k, E)`` and the tile size, never on the routing, so building it needs no ``.item()`` and the
whole MoE step can be captured in a CUDA graph.

- ``sorted_blocks`` (prefill): pairs sorted by expert, each expert's run padded to a multiple of
  ``block_m``; a block of ``block_m`` rows belongs to one expert. At most ``⌈P/block_m⌉ + min(E, P)``
  blocks are non-empty, so that is the static grid; unused blocks carry expert −1 and exit at once.
- ``pair_blocks`` (decode): one block per pair, no sorting at all. For a handful of tokens every
  pair tends to hit a different expert anyway, and skipping the sort saves a dozen small launches.
  ``pair_view`` is the same layout left implicit (no launch): the Triton kernels derive it.
- ``layout_kernel.small_sorted_blocks``: ``sorted_blocks`` built by one Triton launch, for small steps.
- ``contiguous_rows`` (DeepGEMM's contiguous layout): ``sorted_blocks`` at the library's M alignment,
  with a per-row expert id (−1 on padding rows).
- ``masked_slots`` (DeepGEMM's masked layout): a ``[E, M_max]`` grid of slots, row ``r`` of expert
  ``e`` holding its ``r``-th pair, with per-expert counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertGroups:
    """Pairs grouped by expert: ``order [P]`` pair indices sorted by expert (stable, so by token within
    an expert); ``sorted_experts [P]`` their experts; ``rank [P]`` each sorted pair's position within its
    expert; ``counts [E]`` pairs per expert (int64). All on the device of ``topk_ids``."""

    order: torch.Tensor
    sorted_experts: torch.Tensor
    rank: torch.Tensor
    counts: torch.Tensor


@dataclass(frozen=True)
class BlockLayout:
    """Rows of a grouped GEMM in tiles of ``block_m``: ``pairs [num_blocks · block_m]`` int32 pair index
    of each row (``num_pairs`` marks a padding row); ``block_expert [num_blocks]`` int32 expert of each
    block (−1: unused block). ``one_pair_per_block`` (``pair_view``): block ``p`` holds pair ``p`` in its
    first row and padding in the rest, implied rather than stored (``pairs`` is then not read), and
    ``block_expert`` is ``topk_ids`` itself, flattened (int64 as the router gave it)."""

    pairs: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    num_pairs: int
    one_pair_per_block: bool = False

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort the pairs of ``topk_ids [T, k]`` by expert. Counts use ``index_add_`` rather than
    ``bincount``, which reads the maximum id back to the host on CUDA."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=flat.device) - starts[sorted_experts]
    return ExpertGroups(order, sorted_experts, rank, counts)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the non-empty ``block_m``-row blocks when ``num_pairs`` pairs are split among
    ``num_experts`` experts: each expert wastes less than one block, and at most ``min(E, P)`` are used."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def sorted_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                  groups: ExpertGroups | None = None) -> BlockLayout:
    """The prefill layout (see the module docstring)."""
    groups = groups or group_by_expert(topk_ids, num_experts)
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    padded = (groups.counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    dest = pad_start[groups.sorted_experts] + groups.rank
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pairs.scatter_(0, dest, groups.order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=device, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True)  # == E past the last expert
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return BlockLayout(pairs, block_expert, block_m, num_pairs)


def pair_blocks(topk_ids: torch.Tensor, block_m: int) -> BlockLayout:
    """The decode layout: block ``p`` holds pair ``p`` in its first row and padding in the rest."""
    num_pairs = topk_ids.numel()
    pairs = torch.full((num_pairs, block_m), num_pairs, dtype=torch.int32, device=topk_ids.device)
    pairs[:, 0] = torch.arange(num_pairs, dtype=torch.int32, device=topk_ids.device)
    return BlockLayout(pairs.reshape(-1), topk_ids.reshape(-1).to(torch.int32), block_m, num_pairs)


def pair_view(topk_ids: torch.Tensor, block_m: int) -> BlockLayout:
    """``pair_blocks`` with nothing built: kernels that read ``one_pair_per_block`` derive each block's
    rows from its index, so the decode layout costs no launch (a copy only if ``topk_ids`` is not
    contiguous)."""
    flat = topk_ids.reshape(-1)
    return BlockLayout(flat, flat, block_m, flat.numel(), one_pair_per_block=True)


def contiguous_rows(topk_ids: torch.Tensor, num_experts: int, alignment: int) -> tuple[BlockLayout, torch.Tensor]:
    """DeepGEMM's contiguous layout: the ``sorted_blocks`` layout at ``alignment`` rows and
    ``row_expert [rows]`` int32, the expert of each row with −1 on padding rows (the library skips
    blocks whose rows are −1; each expert's run starts at a multiple of ``alignment``)."""
    layout = sorted_blocks(topk_ids, num_experts, alignment)
    row_expert = layout.block_expert.repeat_interleave(alignment)
    row_expert = torch.where(layout.pairs < layout.num_pairs, row_expert, -1)
    return layout, row_expert.contiguous()


@dataclass(frozen=True)
class MaskedSlots:
    """DeepGEMM's masked layout: ``slot [P]`` the flat slot ``e · m_max + r`` of each pair (pair order);
    ``counts [E]`` int32 valid rows per expert; ``m_max`` rows per expert."""

    slot: torch.Tensor
    counts: torch.Tensor
    m_max: int


def masked_slots(topk_ids: torch.Tensor, num_experts: int, align: int = 64) -> MaskedSlots:
    """Each token picks an expert at most once, so no expert gets more than ``T`` rows: ``m_max`` is
    ``T`` rounded up to ``align`` (static, whatever the routing)."""
    groups = group_by_expert(topk_ids, num_experts)
    tokens = topk_ids.shape[0]
    m_max = -(-tokens // align) * align
    slot = torch.empty_like(groups.order)
    slot[groups.order] = groups.sorted_experts * m_max + groups.rank
    return MaskedSlots(slot, groups.counts.to(torch.int32), m_max)
