"""Weights on transparent huge pages: ``HugePageArena`` copies tensors into anonymous memory advised
``MADV_HUGEPAGE``.

A batch-1 decode step streams every weight once, and with 4 KB pages a 540 MB float32 SmolLM2 costs a TLB
miss every 4 KB of the stream. On this project's VM (Linux 6.18, THP ``madvise`` mode) one-row GEMVs over a
whole step's weights ran at 23.3 GB/s from torch's ordinary allocations and at 28–29 GB/s from huge pages
(llama.cpp gets them from its memory-mapped GGUF file's large page-cache folios): docs/benchmarks.md. torch
allocates huge pages only under ``THP_MEM_ALLOC_ENABLE=1`` read at start-up, so the GEMM backends place the
weights they prepare here instead.

The arena maps private anonymous regions (shared ones are shmem, which THP ``madvise`` mode leaves on 4 KB
pages) of at least ``CHUNK`` bytes, aligned to 2 MB, and hands out 64-byte-aligned slices in order; each slice
is a tensor viewing its region, which lives as long as a tensor does. Pages are committed when written, so
the unused end of the last region costs nothing. Where the platform has no ``MADV_HUGEPAGE`` (or is not
Linux) the tensors stay where they are; where the kernel refuses the advice they are still copied (to
ordinary pages).
"""

from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # bytes per region (a larger tensor gets a region of its own size)
ALIGN = 64  # bytes: a cache line, and any dtype's alignment


def supported() -> bool:
    """Whether this platform can advise huge pages for anonymous memory."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


class HugePageArena:
    """Places tensors on huge pages (module docstring)."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self._region: mmap.mmap | None = None
        self._next = self._end = 0  # free span [next, end) of the current region, in bytes from its start
        self.placed_bytes = 0
        self.advised = True  # False once the kernel refused MADV_HUGEPAGE

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of the CPU tensor ``tensor`` on huge pages (``tensor`` itself where not
        ``supported()`` or not on the CPU)."""
        if tensor.device.type != "cpu" or not supported():
            return tensor
        size = tensor.numel() * tensor.element_size()
        if self._region is None or self._next + size > self._end:
            self._map(size)
        assert self._region is not None
        out = torch.frombuffer(self._region, dtype=torch.uint8, count=size, offset=self._next)
        out = out.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        self._next += -(-size // ALIGN) * ALIGN
        self.placed_bytes += size
        return out

    def _map(self, size: int) -> None:
        length = max(self.chunk, -(-size // HUGE_PAGE) * HUGE_PAGE) + HUGE_PAGE  # room to align the start
        region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = ctypes.addressof(ctypes.c_char.from_buffer(region))  # the export keeps the region mapped
        first = (-start) % HUGE_PAGE
        try:
            region.madvise(mmap.MADV_HUGEPAGE, first, length - first)
        except OSError:  # a kernel without THP refuses the advice: the region still holds the weights
            self.advised = False
        self._region, self._next, self._end = region, first, length
