"""Cache specs: what each layer stores per token (ARCHITECTURE §6).

A model declares one spec per layer; the pool sizes blocks from the sum of the specs, and every
request has one block table shared by all layers. New kinds (MLA latent, compressed entries, ring
state slots) are new spec classes; the block manager does not change.

The ``dtype`` the paged specs receive is the KV storage dtype (``kv/fp8.py: kv_storage_dtype``). With
``float8_e4m3fn`` every cached vector also gets its UE8M0 scale bytes (one per 32 elements, ``kv/fp8.py``)
in a parallel ``uint8`` tensor appended to the layer's tuple, and ``bytes_per_block`` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.interfaces import LayerCacheInfo
from deepinfer.kv.fp8 import FP8_DTYPE, num_groups
from deepinfer.kv.memory import cache_zeros


class CacheSpec(Protocol):
    """One layer's cache: its bytes per block and how to allocate its device tensors."""

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int: ...
    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, ...]: ...
    def info(self) -> LayerCacheInfo: ...


@dataclass(frozen=True)
class PagedKVSpec:
    """Paged K and V for every token: two ``[num_blocks, block_size, num_kv_heads, head_dim]``
    tensors; in FP8 (``dtype`` ``float8_e4m3fn``) followed by their two scale tensors ``[num_blocks,
    block_size, num_kv_heads, groups(head_dim)]`` (uint8), i.e. ``(k, v, k_scales, v_scales)``.
    ``window`` > 0 restricts what attention reads to the last ``window`` positions."""

    num_kv_heads: int
    head_dim: int
    window: int = 0
    kv_dtypes = ("bf16", "fp8")  # cache.kv_dtype values besides auto (kv/pools.check_kv_dtype)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        per_head = self.head_dim * dtype.itemsize + (num_groups(self.head_dim) if dtype == FP8_DTYPE else 0)
        return 2 * block_size * self.num_kv_heads * per_head

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, ...]:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        kv = (cache_zeros(shape, dtype, device), cache_zeros(shape, dtype, device))
        if dtype != FP8_DTYPE:
            return kv
        scales = (*shape[:-1], num_groups(self.head_dim))
        return (*kv, cache_zeros(scales, torch.uint8, device), cache_zeros(scales, torch.uint8, device))

    def info(self) -> LayerCacheInfo:
        return LayerCacheInfo(kind="sliding" if self.window else "full", window=self.window)


@dataclass(frozen=True)
class PagedLatentSpec:
    """MLA's paged latent cache (DeepSeek-V2/V3): per token the compressed KV latent
    (``latent_dim`` = ``kv_lora_rank``, after ``kv_a_layernorm``) and the shared rope key
    (``rope_dim``, already rotated), side by side in one ``[num_blocks, block_size,
    latent_dim + rope_dim]`` tensor. In FP8 the whole row is quantized, rope part included, as the
    reference stores its 512-wide MLA rows whose last 64 dims carry RoPE (``reference/deepinfer.md §3,
    §8``); groups of 32 restart at ``k_pe`` (a group never mixes the latent's and the rope key's
    magnitudes), and the scales follow as ``[num_blocks, block_size, groups(latent_dim) + groups(rope_dim)]``
    (uint8; 18 bytes at DeepSeek-V3's 512 + 64)."""

    latent_dim: int
    rope_dim: int
    kv_dtypes = ("bf16", "fp8")

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        row = (self.latent_dim + self.rope_dim) * dtype.itemsize
        return block_size * (row + (self.scale_bytes() if dtype == FP8_DTYPE else 0))

    def scale_bytes(self) -> int:
        """UE8M0 scale bytes per FP8 row: the latent's groups, then the rope key's."""
        return num_groups(self.latent_dim) + num_groups(self.rope_dim)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, ...]:
        rows = cache_zeros((num_blocks, block_size, self.latent_dim + self.rope_dim), dtype, device)
        if dtype != FP8_DTYPE:
            return (rows,)
        return rows, cache_zeros((num_blocks, block_size, self.scale_bytes()), torch.uint8, device)

    def info(self) -> LayerCacheInfo:
        return LayerCacheInfo(kind="full")
