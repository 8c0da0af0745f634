"""Cache specs: what each layer stores per token (ARCHITECTURE §6).

A model declares one spec per layer; the pool sizes blocks from the sum of the specs, and every
request has one block table shared by all layers. New kinds (MLA latent, compressed entries, ring
state slots) are new spec classes; the block manager does not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.interfaces import LayerCacheInfo


class CacheSpec(Protocol):
    """One layer's cache: its bytes per block and how to allocate its device tensors."""

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int: ...
    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, ...]: ...
    def info(self) -> LayerCacheInfo: ...


@dataclass(frozen=True)
class PagedKVSpec:
    """Paged K and V for every token: two ``[num_blocks, block_size, num_kv_heads, head_dim]``
    tensors. ``window`` > 0 restricts what attention reads to the last ``window`` positions."""

    num_kv_heads: int
    head_dim: int
    window: int = 0

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, ...]:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def info(self) -> LayerCacheInfo:
        return LayerCacheInfo(kind="sliding" if self.window else "full", window=self.window)


@dataclass(frozen=True)
class PagedLatentSpec:
    """MLA's paged latent cache (DeepSeek-V2/V3): per token the compressed KV latent
    (``latent_dim`` = ``kv_lora_rank``, after ``kv_a_layernorm``) and the shared rope key
    (``rope_dim``, already rotated), side by side in one ``[num_blocks, block_size,
    latent_dim + rope_dim]`` tensor."""

    latent_dim: int
    rope_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * (self.latent_dim + self.rope_dim) * dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(num_blocks, block_size, self.latent_dim + self.rope_dim, dtype=dtype, device=device),)

    def info(self) -> LayerCacheInfo:
        return LayerCacheInfo(kind="full")
