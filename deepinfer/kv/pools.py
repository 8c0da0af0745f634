"""Device tensors of the KV cache, carved per layer from one block budget."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.errors import ConfigError
from deepinfer.kv.fp8 import KV_DTYPES
from deepinfer.kv.specs import CacheSpec

# Block 0 is never handed out: padding rows of a batch write into it.
RESERVED_BLOCKS = 1


def check_kv_dtype(specs: Sequence[CacheSpec], kv_dtype: torch.dtype, model_dtype: torch.dtype,
                   setting: str) -> None:
    """Refuse a ``cache.kv_dtype`` (``setting``; ``kv_dtype`` its storage dtype) that some layer's cache does
    not store: each spec names the values besides ``auto`` it reads (``kv_dtypes``: GQA and MLA rows ``bf16``
    and ``fp8``; DeepSeek-V4's hybrid caches ``fp8``, V4.1's ``fp8`` and ``fp4``, ``kv/v41_cache.py``). A
    value whose storage dtype is the model's (``bf16`` on a bf16 model) is ``auto``."""
    if kv_dtype == model_dtype:
        return
    allowed = set(KV_DTYPES)
    for spec in specs:
        allowed &= set(getattr(spec, "kv_dtypes", ()))
    if setting not in allowed:
        kinds = ", ".join(sorted({type(s).__name__ for s in specs}))
        values = ", ".join(repr(v) for v in ("auto", *sorted(allowed)))
        raise ConfigError(f"cache.kv_dtype={setting!r}: the model's caches ({kinds}) do not store it; "
                          f"allowed values for this model: {values}")
    for spec in specs:
        try:
            if hasattr(spec, "layouts"):
                spec.layouts(kv_dtype)
        except ValueError as e:
            raise ConfigError(f"cache.kv_dtype={setting!r}: {e}") from e


def bytes_per_block(specs: Sequence[CacheSpec], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, ``dtype`` being the KV storage dtype (scales of FP8
    rows included, ``kv/fp8.py``)."""
    return sum(spec.bytes_per_block(block_size, dtype) for spec in specs)


def num_blocks_for(budget_bytes: int, specs: Sequence[CacheSpec], block_size: int, dtype: torch.dtype,
                   extra_per_block: int = 0) -> int:
    """How many blocks (including the reserved one) fit in ``budget_bytes``, each taking the specs' bytes
    and ``extra_per_block`` more (rows kept per slot outside the specs, e.g. a drafter's)."""
    per_block = bytes_per_block(specs, block_size, dtype) + extra_per_block
    blocks = budget_bytes // per_block
    if blocks <= RESERVED_BLOCKS:
        raise ConfigError(
            f"cache.kv_cache_bytes={budget_bytes} holds {blocks} blocks of {per_block} bytes; "
            f"at least {RESERVED_BLOCKS + 1} are needed"
        )
    return int(blocks)


def state_bytes(specs: Sequence[CacheSpec], num_slots: int, max_backtrack: int, dtype: torch.dtype,
                kv_dtype: torch.dtype | None = None) -> int:
    """Bytes the state-slot rings of all layers take (``kv/state.py``; 0 for models without state);
    ``kv_dtype``: the KV storage dtype, which the sliding-window rings follow (``kv/v41_cache.py``)."""
    per_slot = sum(spec.bytes_per_slot(max_backtrack, dtype, kv_dtype)
                   for spec in specs if hasattr(spec, "bytes_per_slot"))
    return num_slots * per_slot


class KVPool:
    """One tuple of cache tensors per layer, all indexed by the same block ids; a layer whose spec keeps
    per-request state (``kv/state.py``) gets its ring tensors for ``num_state_slots`` slots appended.
    Paged rows are stored in ``kv_dtype`` (``None``: ``dtype``, the model's; ``kv/fp8.py``), state
    rings in ``dtype`` but for the sliding-window rings of V4/V4.1 under ``fp8``/``fp4`` (``kv/v41_cache.py``)."""

    def __init__(self, specs: Sequence[CacheSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_state_slots: int = 0, max_backtrack: int = 1,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.layers = [spec.allocate(num_blocks, block_size, kv_dtype or dtype, device) for spec in specs]
        # The block-indexed tensors of every layer, in layer order (state rings, indexed by slot, excluded).
        self.paged = [t for layer in self.layers for t in layer]
        for i, spec in enumerate(specs):
            if hasattr(spec, "allocate_state"):
                self.layers[i] = self.layers[i] + spec.allocate_state(num_state_slots, max_backtrack, dtype, device,
                                                                      kv_dtype)
