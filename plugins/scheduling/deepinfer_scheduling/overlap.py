"""The overlapped step executor (the reference's zero-overhead scheduler, reference/deepinfer.md §2).

While the device runs step N+1, the host post-processes step N. One ``step()`` call:

1. schedule N+1 on optimistic state (step N's tokens are still unread; they stand as pending);
2. prepare N+1 on the host, with the remap of its pending input tokens onto N's sampled rows, and
   hand it to the device, which fills those inputs from N's results and runs forward and sampling;
3. wait for step N (the one event the host waits on) and post-process it: commit tokens, stops,
   outputs, release of blocks that N+1 no longer touches.

With ``launch="thread"`` the "device" is one worker thread that runs steps strictly in order, like a CUDA
stream, so the overlap is real on CPU too (torch releases the GIL inside its kernels). With
``launch="inline"`` (a CUDA device) the host thread enqueues step N+1 itself before it waits for N: the
stream keeps the order and the device runs N+1 while the host processes N, with no second Python thread
contending for the GIL. Outputs equal the
synchronous executor's: every draw is a pure function of (seed, position), and results of requests
preempted, aborted or finished while a step was in flight are dropped (core ``process``).

Under speculative decoding a request whose step N is in flight runs in N+1 too: the core drafts on the
device inside each step and fixes N+1's follow-up rows up from N's results before the forward
(``engine/followup.py``; the README).
Steps 1–2 (the launch path) run inside the sync guard's ``launching`` scope, step 3's read inside
its ``reading`` scope (``sync_guard.py``; a no-op unless ``plugins.scheduling.sync_guard``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from deepinfer.interfaces import StepContext
from deepinfer_scheduling.sync_guard import SyncGuard


@dataclass
class _InFlight:
    scheduled: Any
    future: Future


class DeviceTimeline:
    """Busy intervals of the device worker, for the idle time between steps, and the host's waits on it.

    ``host_wait`` is the time the host blocked on a step's results: near zero when the host's own work
    (scheduling, preparing, processing) is what bounds the step rate, near the step time when the device is.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.busy = 0.0
        self.idle = 0.0
        self.host_wait = 0.0
        self._last_end: float | None = None

    def record(self, start: float, end: float) -> None:
        with self._lock:
            if self._last_end is not None:
                self.idle += max(0.0, start - self._last_end)
            self._last_end = end
            self.busy += end - start
            self.steps += 1

    def record_wait(self, seconds: float) -> None:
        with self._lock:
            self.host_wait += seconds

    def mark_drained(self) -> None:
        """The executor ran out of work: the gap until the next step is not the executor's idle time."""
        with self._lock:
            self._last_end = None

    def stats(self) -> dict[str, float]:
        """The worker's steps, busy and idle seconds and idle fraction (absent when no worker ran a step:
        ``launch="inline"``), and the host's waits."""
        with self._lock:
            if not self.steps:
                return {"host_wait_s": self.host_wait}
            total = self.busy + self.idle
            return {"device_steps": self.steps, "device_busy_s": self.busy, "device_idle_s": self.idle,
                    "device_idle_fraction": self.idle / total if total else 0.0, "host_wait_s": self.host_wait}


class OverlapExecutor:
    """Runs step N+1 on the device while the host post-processes step N."""

    def __init__(self, context: StepContext, guard: SyncGuard | None = None, *, inline: bool = False) -> None:
        self.context = context
        self.guard = guard or SyncGuard(enabled=False)
        # inline: the caller's thread launches each step (an asynchronous device keeps the overlap).
        self.device = None if inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-device")
        self.timeline = DeviceTimeline()
        self.inflight: _InFlight | None = None

    def step(self) -> list[Any]:
        launched = None
        try:
            scheduled = self.context.schedule()
            if not scheduled.is_empty:
                previous = self.inflight
                with self.guard.launching():
                    prepared = self.context.prepare(scheduled, previous.scheduled if previous else None)
                launched = _InFlight(scheduled, self._launch(prepared, previous.future if previous else None))
            if self.inflight is None:
                outputs = self.context.process(None, None)
            else:
                waited = time.perf_counter()
                results = self.inflight.future.result()
                self.timeline.record_wait(time.perf_counter() - waited)
                with self.guard.reading():
                    outputs = self.context.process(self.inflight.scheduled, results)
        except BaseException:
            self._drop_inflight(launched)
            raise
        self.inflight = launched
        if launched is None:
            self.timeline.mark_drained()
        return outputs

    def _drop_inflight(self, launched: _InFlight | None) -> None:
        """A step raised (an interrupt, a failing plugin): wait until the device has finished the steps
        it was given, whatever they raise, and forget them; the engine then aborts their requests
        (``EngineCore.abort_after_failed_step``), whose blocks the device no longer touches."""
        pending = [f.future for f in (self.inflight, launched) if f is not None]
        self.inflight = None
        wait(pending)
        self.timeline.mark_drained()

    def _launch(self, prepared: Any, previous: Future | None) -> Future:
        if self.device is not None:
            return self.device.submit(self._device_step, prepared, previous)
        future: Future = Future()
        future.set_result(self._device_step(prepared, previous))  # raises into step(), which drops the rest
        return future

    def _device_step(self, prepared: Any, previous: Future | None) -> Any:
        # The worker runs steps in order, so the previous step is complete here.
        previous_results = previous.result() if previous is not None else None
        start = time.perf_counter()
        with self.guard.launching():
            results = self.context.run(prepared, previous_results)
        if self.device is not None:  # inline, the host's own launch time is no device interval (the core's
            self.timeline.record(start, time.perf_counter())  # CUDA events time the device: get_stats()["device_*"])
        return results

    def shutdown(self) -> None:
        if self.device is not None:
            self.device.shutdown(wait=True)
