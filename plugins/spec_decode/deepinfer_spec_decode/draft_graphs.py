"""CUDA graphs for a drafter's device work (the ``dspark`` drafter's context write and block drafting).

Run eagerly, a drafting step is a few hundred small kernels (two drafter layers, then the draft loop
over ``k`` positions), each paid in host launch time: on the H200 with SmolLM2 that was 7–15 ms per
drafting step against a 3.4–5.7 ms replayed target step. ``PaddedGraphs`` replays such a function
from CUDA graphs, one per bucket of its inputs' leading dimension (1, 2, 4, 8, every 8 rows to 64, every 32
to 256, then every 128 up to ``limit``: few enough that a server's first minutes capture them all, since
each capture costs tens of milliseconds in a step; larger calls return None and the caller runs eagerly)
and per value of its flags.

- **Inputs** are copied into the graph's static buffers; the rows past the real ones get each input's
  padding value, chosen by the caller so that a padding row is harmless (it writes only the reserved
  scratch slot 0, or reads what no request owns).
- **Outputs** are the graph's static tensors sliced to the real rows. The graphs of one
  ``PaddedGraphs`` share a memory pool and are captured lazily in any order, so an output is valid
  only until the next replay of *any* of them: copy what must outlive it.
- **Capture** happens on first use of a bucket, on the calling thread (under the overlapped executor,
  the engine's device thread) and a side stream, in thread-local capture mode (the host thread may stage
  the next step meanwhile), after one eager warm-up call on the same inputs (library handles, Triton
  compilation), so the function must give the same result when run twice on them: a context write
  writes the same rows again, a block forward is pure. Nothing synchronizes the device.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

Padded = tuple[torch.Tensor, int | float | bool]  # an input and the value of its padding rows
Outputs = tuple[torch.Tensor | None, ...]

# (up to rows, bucket interval) past 8 rows: fewer than 8 padding rows, or than half the real rows
BUCKET_INTERVALS = ((64, 8), (256, 32))
LARGE_INTERVAL = 128


def bucket_of(rows: int, limit: int) -> int | None:
    """The bucket that serves ``rows`` (≥ 1): 1, 2, 4, 8, then the next multiple of 8 to 64, of 32 to 256,
    of 128 above; None past ``limit``."""
    if rows > limit:
        return None
    if rows <= 8:
        return 1 << max(0, rows - 1).bit_length()
    interval = next((step for top, step in BUCKET_INTERVALS if rows <= top), LARGE_INTERVAL)
    return min(-(-rows // interval) * interval, limit)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: Outputs


class PaddedGraphs:
    """``fn(*inputs, *flags) -> tuple of tensors (or None)``, every tensor's leading dimension the rows,
    replayed from CUDA graphs (module docstring)."""

    def __init__(self, fn: Callable[..., Outputs], limit: int, device: torch.device) -> None:
        self.fn = fn
        self.limit = limit
        self.device = device
        self.graphs: dict[Hashable, _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, rows: int, inputs: Sequence[Padded], *flags: Hashable) -> Outputs | None:
        """``fn`` over the first ``rows`` rows of ``inputs`` (each ``(tensor, padding value)``), from the
        graph of their bucket; None when ``rows`` is past ``limit`` (run ``fn`` eagerly then)."""
        bucket = bucket_of(rows, self.limit)
        if bucket is None:
            return None
        key = (bucket, flags, tuple((t.dtype, tuple(t.shape[1:])) for t, _ in inputs))
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = self._capture(bucket, rows, inputs, flags)
        else:
            self._load(captured, rows, inputs)
        captured.graph.replay()
        return tuple(None if out is None else out[:rows] for out in captured.outputs)

    @staticmethod
    def _load(captured: _Captured, rows: int, inputs: Sequence[Padded]) -> None:
        for static, (tensor, pad) in zip(captured.inputs, inputs, strict=True):
            static[:rows].copy_(tensor)
            if rows < static.shape[0]:
                static[rows:].fill_(pad)

    def _capture(self, bucket: int, rows: int, inputs: Sequence[Padded], flags: tuple[Hashable, ...]) -> _Captured:
        statics = [torch.full((bucket, *t.shape[1:]), pad, dtype=t.dtype, device=t.device) for t, pad in inputs]
        for static, (tensor, _) in zip(statics, inputs, strict=True):
            static[:rows].copy_(tensor)
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        # A graph the garbage collector freed during the capture (an old engine's) would fail its reset; no
        # collection before it either: captures happen while serving, and a full collection takes milliseconds.
        gc.disable()
        try:
            with torch.cuda.stream(stream):
                self.fn(*statics, *flags)  # warm-up: library handles, kernel compilation
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    outputs = self.fn(*statics, *flags)
                finally:
                    graph.capture_end()
        finally:
            gc.enable()
        current.wait_stream(stream)
        return _Captured(graph, statics, outputs)
