"""Host → device copies of a step's inputs that never make the host wait.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then synchronizes the stream
(``torch.cuda.set_sync_debug_mode`` reports it as a synchronizing operation). ``to_device`` builds the
tensor in pinned host memory and enqueues a non-blocking copy instead, so building a step's inputs
never waits for the device (the launch path of the overlapped executor, plugins/scheduling). torch's
caching host allocator keeps each pinned block alive until the copy that reads it has run.

``to_device_many`` sends several lists in one copy per dtype (a copy costs ~10 µs of host time on
CUDA, and a speculative step has a dozen small lists for verification alone).

``to_host`` is the way back: a step's results are copied into pinned host memory right after they are
computed and one event is recorded, so the host waits for exactly that step, not for the steps queued
behind it on the stream.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, or nested lists of one shape) as a tensor on ``device``; on CUDA through a
    pinned host tensor and a non-blocking copy, elsewhere directly."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    if not values:  # nothing to copy (and nothing to pin)
        return torch.empty(0, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)



def to_device_many(items: Sequence[tuple[list, torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """``to_device`` of every ``(values, dtype)`` of ``items`` (a list, or a rectangular list of lists), with
    one host → device copy per dtype: the lists of one dtype are packed into one buffer (pinned on CUDA),
    copied, and handed back as views of it, in the order given (packed on every device, so that the CPU
    tests run the same code)."""
    shapes: list[tuple[int, ...]] = []
    flats: dict[torch.dtype, list] = {}
    for values, dtype in items:
        flat = flats.setdefault(dtype, [])
        if values and isinstance(values[0], list):
            shapes.append((len(values), len(values[0])))
            for row in values:
                flat.extend(row)
        else:
            shapes.append((len(values),))
            flat.extend(values)
    sizes: dict[torch.dtype, list[int]] = {dtype: [] for dtype in flats}
    for (_, dtype), shape in zip(items, shapes, strict=True):
        sizes[dtype].append(math.prod(shape))
    # One split per buffer: its views in one dispatched op (a slice and a view per list cost host time too).
    parts = {dtype: iter(to_device(flat, dtype, device).split(sizes[dtype])) for dtype, flat in flats.items()}
    out = []
    for (_, dtype), shape in zip(items, shapes, strict=True):
        part = next(parts[dtype])
        out.append(part.view(shape) if len(shape) > 1 else part)
    return out


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def to_host(value: T) -> T:
    """A copy of the dataclass ``value`` whose CUDA tensor fields are being copied, non-blocking, into
    pinned host memory (other fields are kept). The copies are valid once the stream has run them:
    record an event after this call and wait on it before reading."""
    changes = {f.name: pinned_copy(getattr(value, f.name)) for f in dataclasses.fields(value)
               if isinstance(getattr(value, f.name), torch.Tensor)}
    return dataclasses.replace(value, **changes)
