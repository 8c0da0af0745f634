"""Giving the C heap's free memory back to the system on CPU runs (glibc's ``malloc_trim``).

glibc raises its mmap threshold as large blocks are freed (up to 32 MiB), so later tensors up to that size come from
its heaps; when a step's shapes keep changing (verification rows under speculative decoding, prompt chunks) the
heaps fragment, and the process keeps free memory it does not reuse. Measured on the 2-core Xeon
(``docs/benchmarks.md``, "the C heap of a CPU run"): SmolLM2 float32 at batch 64 with ``fixed`` speculation grew
~200 MiB a wave of 64 requests where plain decoding stayed flat, and a benchmark process that ran five batch sizes
was killed at 24 GB; ``malloc_trim(0)`` gave the growth back (4–22 ms a call). Pinning the threshold instead
(``MALLOC_MMAP_THRESHOLD_``) cost 10–18% of a batch-64 step in page faults. So a CPU engine looks at its resident
size every ``CHECK_EVERY`` steps and when it runs out of work, and trims once it grew ``GROWTH_BYTES`` past the
size after the last trim. Elsewhere than glibc on Linux the trimmer does nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

CHECK_EVERY = 16  # steps between two reads of the resident size (a read costs ~10 µs)
GROWTH_BYTES = 512 << 20  # growth past the last trim that asks for a trim


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def resident_bytes() -> int | None:
    """This process's resident set size (Linux ``/proc/self/statm``), None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """Trims the C heap when the process grew ``growth`` bytes past its size after the last trim (module
    docstring). ``trim`` and ``measure`` are glibc's ``malloc_trim`` and ``resident_bytes`` unless given."""

    def __init__(self, *, growth: int = GROWTH_BYTES, check_every: int = CHECK_EVERY,
                 trim: Callable[[int], int] | None = None, measure: Callable[[], int | None] = resident_bytes) -> None:
        self._trim = trim if trim is not None else _glibc_malloc_trim()
        self._measure = measure
        self.growth, self.check_every = growth, check_every
        self.steps = 0
        self.trims = 0
        self.floor = measure() if self._trim is not None else None

    def after_step(self, drained: bool) -> None:
        """Called after every engine step; ``drained``: the engine has no work left."""
        if self._trim is None or self.floor is None:
            return
        self.steps += 1
        if not drained and self.steps % self.check_every:
            return
        size = self._measure()
        if size is not None and size - self.floor > self.growth:
            self._trim(0)
            self.trims += 1
            self.floor = self._measure() or size
