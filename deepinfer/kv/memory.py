"""Zeroed cache tensors that cost host memory only where they are written.

``torch.zeros`` on the CPU writes every byte, so a CPU engine's default 2 GiB KV budget became 2 GiB of
resident memory at start-up, whatever it then served (and a process that builds several engines, a test
suite, held several). ``cache_zeros`` takes large CPU caches from an anonymous private mapping instead:
the kernel hands out zero pages as they are first written, so the cache reads as zeros everywhere (as
replays and padded rows rely on) and its resident size grows with the blocks in use. Other devices, and
small tensors, get ``torch.zeros``.
"""

from __future__ import annotations

import math
import mmap

import torch

LAZY_MIN_BYTES = 1 << 20  # below this the mapping's bookkeeping is not worth it


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A contiguous tensor of zeros of ``shape`` and ``dtype`` on ``device`` (module docstring)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < LAZY_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps the mapping alive for as long as the tensor (and its views) live
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
