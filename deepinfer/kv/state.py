"""Cache specs for layers that keep per-request state (ARCHITECTURE §6): paged compressed entries and
state-slot rings.

Two kinds of storage, one spec per layer (``HybridLayerSpec``):

- **Paged compressed entries** (``CompressedPart``): one entry per ``ratio`` token positions, so a
  block of ``block_size`` positions holds ``block_size // ratio`` entries, stored as
  ``[num_blocks, block_size // ratio, width]``. Entry ``e`` of a request lives in block
  ``table[e // per_block]`` at row ``e % per_block``; it is a function of the prefix only, so it is
  shared through the prefix cache like any paged KV. (DeepSeek-V4 compressed KV and indexer keys.)
- **Rings in a state slot** (``RingPart``): per request, ``span + max_backtrack`` rows of ``width``
  values, stored as ``[num_slots, span + max_backtrack, width]``. The row of token position ``p`` is
  ``p % ring_size``. A layer writes the rows of the positions it computes and reads back the last
  ``span`` positions before a step, so "rolling back k ≤ max_backtrack tokens" needs no undo: the
  positions that remain are still in the ring, and the dropped ones are rewritten when recomputed.
  (DeepSeek-V4 sliding-window keys: ``span = window``; compressor inputs: ``span`` = the tokens a
  compressed entry reads.) Slot 0 is never handed out.

Slots are allocated per running request by ``KVCacheManager`` (``kv/blocks.py``) and freed with its
blocks; ``KVPool`` allocates the ring tensors for ``num_state_slots`` slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from deepinfer.errors import ConfigError
from deepinfer.interfaces import LayerCacheInfo
from deepinfer.kv import v41_cache

RESERVED_SLOTS = 1  # slot 0 is never handed out


def num_state_slots_for(max_num_seqs: int) -> int:
    """State slots to allocate: every running request holds one, plus headroom for requests that
    finished while a step was in flight (their slot is released after that step), plus slot 0."""
    return max_num_seqs + max(1, max_num_seqs // 4) + RESERVED_SLOTS


@dataclass(frozen=True)
class CompressedPart:
    """Paged compressed entries: one ``width``-vector per ``ratio`` token positions; ``index``: V4.1's
    indexer keys, which take the ``FP4_INDEX`` layout under ``cache.kv_dtype`` fp8/fp4 (``kv/v41_cache.py``)."""

    ratio: int
    width: int
    index: bool = False

    def entries_per_block(self, block_size: int) -> int:
        if block_size % self.ratio:
            raise ConfigError(f"cache.block_size={block_size} must be a multiple of the compression ratio "
                              f"{self.ratio} (each block holds block_size / ratio compressed entries)")
        return block_size // self.ratio


@dataclass(frozen=True)
class RingPart:
    """A per-request ring of ``span + max_backtrack`` rows of ``width`` values; ``sliding``: a layer's
    sliding-window keys, which take the ``MXFP8`` layout under ``cache.kv_dtype`` fp8/fp4 (``kv/v41_cache.py``;
    other rings stay in the model dtype)."""

    span: int
    width: int
    sliding: bool = False

    def format(self, kv_dtype: torch.dtype) -> v41_cache.V41KVFormat | None:
        """The ring's layout under KV storage dtype ``kv_dtype`` (None: the model dtype)."""
        return v41_cache.ring_format(kv_dtype, self.width) if self.sliding else None

    def size(self, max_backtrack: int) -> int:
        return self.span + max_backtrack


@dataclass(frozen=True)
class HybridLayerSpec:
    """One layer's paged compressed parts and state-slot rings.

    ``allocate`` returns the paged tensors (in ``paged`` order), ``allocate_state`` the rings (in
    ``rings`` order); ``KVPool`` hands the layer both, paged first. ``kind``/``window``/``ratio``/
    ``role`` describe the layer for replay planners (``LayerCacheInfo``). ``kv_dtypes``: the
    ``cache.kv_dtype`` values besides ``auto`` the layer's attention reads (``kv/pools.check_kv_dtype``); under
    them the paged parts and the sliding ring take V4.1's layouts (``kv/v41_cache.py``)."""

    paged: tuple[CompressedPart, ...]
    rings: tuple[RingPart, ...]
    kind: Literal["sliding", "compressed"]
    window: int
    ratio: int = 1
    role: Literal["plain", "producer", "consumer"] = "plain"
    kv_dtypes: tuple[str, ...] = ()

    def layouts(self, kv_dtype: torch.dtype) -> list[v41_cache.V41KVFormat | None]:
        """The layout of each paged part, then of each ring, under KV storage dtype ``kv_dtype`` (None: a float
        dtype); ``ValueError`` naming the layout when a part's width is not a multiple of its scale group."""
        return ([v41_cache.entry_format(kv_dtype, p.width, p.index) for p in self.paged]
                + [r.format(kv_dtype) for r in self.rings])

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of the paged parts per block, ``dtype`` being the KV storage dtype."""
        return sum(p.entries_per_block(block_size)
                   * v41_cache.row_bytes(v41_cache.entry_format(dtype, p.width, p.index), p.width, dtype)
                   for p in self.paged)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, ...]:
        return tuple(v41_cache.allocate((num_blocks, p.entries_per_block(block_size)), p.width,
                                        v41_cache.entry_format(dtype, p.width, p.index), dtype, device)
                     for p in self.paged)

    def bytes_per_slot(self, max_backtrack: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> int:
        """Bytes of the rings per state slot: ``dtype`` the model's, ``kv_dtype`` the KV storage dtype."""
        kv_dtype = kv_dtype or dtype
        return sum(r.size(max_backtrack) * v41_cache.row_bytes(r.format(kv_dtype), r.width, dtype) for r in self.rings)

    def allocate_state(self, num_slots: int, max_backtrack: int, dtype: torch.dtype,
                       device: torch.device, kv_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        # Zeros, not empty: a replay reads ring rows older than its first token (they never reach
        # the restored state, but they must be finite; zero bytes decode to zeros in every layout).
        kv_dtype = kv_dtype or dtype
        return tuple(v41_cache.allocate((num_slots, r.size(max_backtrack)), r.width, r.format(kv_dtype), dtype, device)
                     for r in self.rings)

    def info(self) -> LayerCacheInfo:
        return LayerCacheInfo(kind=self.kind, window=self.window, ratio=self.ratio, role=self.role)


def has_state(spec: object) -> bool:
    """Whether a cache spec keeps per-request state slots."""
    return hasattr(spec, "allocate_state")
