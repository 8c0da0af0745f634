"""The step-cost model: step time as a function of the query tokens in a step (reference/deepinfer.md §5).

A curve of (query tokens, seconds) is profiled on placeholder batches as far as it is needed: sizes
are powers of two (then the largest step) and a size is measured the first time a query reaches
it (one warm-up and five timed forwards; the extremes are dropped and the middle three averaged), so
a small batch never pays for profiling a large one. The curve is then corrected online: each
observed decode step adds its normalized residual ``(seconds − curve(q)) / q`` to a window, a
median is kept per profiled size (sizes with at least ``min_samples`` samples count), and the
median of those medians is a per-token slope added to the curve (never negative). The curve
ignores context length, as the reference's does.

On a GPU with CUDA graphs the whole curve is profiled at start-up, one point per graph bucket (the
time of a replay), and may be cached on disk (``CurveCache``: one JSON file per run shape, reused
while younger than its TTL), as the reference's decode-perf cache does.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def profile_sizes(max_tokens: int) -> list[int]:
    """Query-token sizes to profile: powers of two up to ``max_tokens``, and ``max_tokens`` itself."""
    sizes, q = [], 1
    while q < max_tokens:
        sizes.append(q)
        q *= 2
    return [*sizes, max_tokens]


def time_call(fn: Callable[[], None], device: torch.device, *, warmup: int = 1, repeats: int = 5) -> float:
    """Seconds per call: the mean of the middle runs of ``repeats`` (min and max dropped)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    middle = times[1:-1] if len(times) > 2 else times
    return sum(middle) / len(middle)


class StepCost:
    """``StepCostModel`` over a curve that ``measure(query_tokens) -> seconds`` fills on demand, up
    to ``max_tokens``, at ``sizes`` (default ``profile_sizes(max_tokens)``)."""

    def __init__(self, measure: Callable[[int], float], max_tokens: int, *, sizes: Sequence[int] | None = None,
                 window: int = 5000, min_samples: int = 10) -> None:
        self._measure = measure
        self._todo = sorted(sizes) if sizes else profile_sizes(max_tokens)
        self._sizes: list[int] = []
        self._seconds: list[float] = []
        self._residuals: deque[tuple[int, float]] = deque(maxlen=window)
        self.min_samples = min_samples

    @property
    def points(self) -> list[tuple[int, float]]:
        """The sizes profiled so far and their seconds."""
        return list(zip(self._sizes, self._seconds, strict=True))

    def profile_all(self) -> None:
        """Profile every remaining size now (start-up profiling)."""
        while self._todo:
            self._profile_up_to(self._todo[-1])

    def load(self, points: Sequence[tuple[int, float]]) -> None:
        """Take a profiled curve (e.g. from ``CurveCache``) instead of measuring it."""
        self._sizes = [int(q) for q, _ in points]
        self._seconds = [float(t) for _, t in points]
        self._todo = []

    def _profile_up_to(self, query_tokens: int) -> None:
        while self._todo and (not self._sizes or self._sizes[-1] < query_tokens):
            size = self._todo.pop(0)
            self._sizes.append(size)
            self._seconds.append(self._measure(size))

    def curve(self, query_tokens: int) -> float:
        """Profiled seconds at ``query_tokens``: linear between profiled sizes, extended past the last
        two, flat below the first."""
        self._profile_up_to(query_tokens)
        sizes, secs = self._sizes, self._seconds
        if query_tokens <= sizes[0] or len(sizes) == 1:
            return secs[0] if query_tokens <= sizes[0] else secs[0] * query_tokens / sizes[0]
        i = min(bisect.bisect_left(sizes, query_tokens), len(sizes) - 1)
        lo, hi = i - 1, i
        frac = (query_tokens - sizes[lo]) / (sizes[hi] - sizes[lo])
        return secs[lo] + frac * (secs[hi] - secs[lo])

    def _bucket(self, query_tokens: int) -> int:
        i = bisect.bisect_left(self._sizes, query_tokens)
        return self._sizes[min(i, len(self._sizes) - 1)]

    def slope(self) -> float:
        """The online per-token correction (seconds per query token, ≥ 0)."""
        by_bucket: dict[int, list[float]] = {}
        for bucket, r in self._residuals:
            by_bucket.setdefault(bucket, []).append(r)
        medians = [statistics.median(v) for v in by_bucket.values() if len(v) >= self.min_samples]
        return max(0.0, statistics.median(medians)) if medians else 0.0

    def step_time(self, query_tokens: int) -> float:
        return self.curve(query_tokens) + self.slope() * query_tokens

    def observe(self, query_tokens: int, seconds: float) -> None:
        if query_tokens <= 0:
            return
        residual = (seconds - self.curve(query_tokens)) / query_tokens
        self._residuals.append((self._bucket(query_tokens), residual))


class CurveCache:
    """Profiled step-cost curves on disk, one JSON file per run shape (``key``: anything that changes
    step time — model, dtype, device, backends, buckets), valid for ``ttl_s`` seconds."""

    def __init__(self, directory: str | Path, ttl_s: float) -> None:
        self.directory = Path(directory)
        self.ttl_s = ttl_s

    def _path(self, key: Mapping[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        return self.directory / f"step-cost-{digest}.json"

    def load(self, key: Mapping[str, Any]) -> list[tuple[int, float]] | None:
        """The cached curve for ``key``, or None when there is none, it expired, or it is unreadable."""
        path = self._path(key)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if time.time() - float(data.get("created", 0)) > self.ttl_s or data.get("key") != json.loads(
                json.dumps(key, sort_keys=True, default=str)):
            return None
        return [(int(q), float(t)) for q, t in data["points"]]

    def save(self, key: Mapping[str, Any], points: Sequence[tuple[int, float]]) -> None:
        """Write atomically (a temporary file, then a rename), so readers never see half a file."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"created": time.time(), "key": key, "points": list(points)}, sort_keys=True,
                                  default=str))
        tmp.replace(path)
        logger.info("step-cost curve cached at %s", path)
