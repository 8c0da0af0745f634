"""The sync guard: a debug mode in which any CUDA synchronization inside the launch path raises.

The launch path is what the overlapped executor does to get a step onto the device: build its inputs
on the host (``prepare``) and enqueue its forward and sampling (``run``, on the device's thread). It
must never wait for the device, or the host stalls behind the step in flight and the overlap is
lost. With ``plugins.scheduling.sync_guard`` on, both run under ``torch.cuda.set_sync_debug_mode
("error")``, so ``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero``, a blocking copy (``torch.tensor(
values, device="cuda")``) and any other synchronizing operation torch knows of raise ``RuntimeError``.

torch's mode is one process-wide switch, and the host's deliberate read of a step's results
(``process``, on the host's thread) overlaps the next launch on the device's thread. As in the
reference (``forbid_cuda_sync`` arbitrated with ``allow_cuda_sync``, reference/deepinfer.md §2.4),
enforcement is therefore on while some launch runs and no read does: a sync on the device's thread
that happens while the host reads goes unseen that time (not every time; the host's own launch work
is always checked). The mode found before the guard switched it on is restored when it switches off.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch


class SyncGuard:
    """Counts launch scopes and read scopes; enforces ``error`` mode while launches and no reads run."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self._lock = threading.Lock()
        self._launching = 0
        self._reading = 0
        self._saved: int | None = None  # torch's mode before enforcement began; None while not enforcing

    def launching(self) -> AbstractContextManager[None]:
        """A scope of the launch path: no CUDA sync allowed (unless a read runs elsewhere)."""
        return self._scope(launching=1)

    def reading(self) -> AbstractContextManager[None]:
        """A scope where the host deliberately reads the device (post-processing a step)."""
        return self._scope(reading=1)

    @contextmanager
    def _scope(self, launching: int = 0, reading: int = 0) -> Iterator[None]:
        """Counts the scope in while it runs (nothing when the guard is off)."""
        if not self.enabled:
            yield
            return
        self._change(launching, reading)
        try:
            yield
        finally:
            self._change(-launching, -reading)

    def _change(self, launching: int = 0, reading: int = 0) -> None:
        with self._lock:
            self._launching += launching
            self._reading += reading
            enforce = self._launching > 0 and self._reading == 0
            if enforce and self._saved is None:
                self._saved = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
            elif not enforce and self._saved is not None:
                torch.cuda.set_sync_debug_mode(self._saved)
                self._saved = None
