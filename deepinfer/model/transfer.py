"""Host → device copies of a step's inputs that never make the host wait.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then synchronizes the stream
(``torch.cuda.set_sync_debug_mode`` reports it as a synchronizing operation). ``to_device`` builds the
tensor in pinned host memory and enqueues a non-blocking copy instead, so building a step's inputs
never waits for the device (the launch path of the overlapped executor, plugins/scheduling). torch's
caching host allocator keeps each pinned block alive until the copy that reads it has run.

``to_host`` is the way back: a step's results are copied into pinned host memory right after they are
computed and one event is recorded, so the host waits for exactly that step, not for the steps queued
behind it on the stream.
"""

from __future__ import annotations

import dataclasses
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
