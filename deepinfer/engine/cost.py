"""The step-cost model: what a decode step costs, in seconds (reference/deepinfer.md §5).

A step of ``q`` query tokens (every one a verified row: a verification step samples each of them)
drafted for ``r`` requests afterwards is charged

    step_time(q, requests=r) = forward(q) + sampler_per_row · q + drafting(r) + host(r > 0)

- ``forward``: a curve of (query tokens, seconds) of forward and LM head, profiled on placeholder
  batches of random token ids (one id repeated would route every row of an MoE layer to the same
  experts). Without CUDA graphs (CPU, eager GPU) sizes are powers of two (then the largest step), each
  measured the first time a query reaches it (one warm-up and five timed forwards; the extremes are
  dropped and the middle three averaged), so a small batch never pays for profiling a large one, and
  the curve is linear between them. The profiled points are fitted non-decreasing first
  (pool-adjacent-violators): on CPU the first sizes, measured while the process is cold, came out
  slower than larger ones, which made verifying drafts look cheaper than decoding. With CUDA graphs
  (``bucketed``) the whole curve is profiled at start-up, one point per graph bucket (the time of a
  replay on ``DecodeGraphs.load_placeholder``'s inputs: random ids at distinct positions), and a step
  is charged as the smallest bucket ≥ ``q``, padding included: that is the graph it replays (a step
  past the largest bucket runs eagerly and is extended linearly). The points may be cached on disk as
  they are profiled (``CurveCache``: one JSON file per run shape, reused while younger than its TTL), as
  the reference's decode-perf cache does: a later engine of the same shape profiles only the sizes none
  before it reached (on CPU a fresh engine's first large steps otherwise stall for the profile of every
  power of two up to them: seconds). It is corrected online: each observed decode step
  adds its residual ``seconds − curve(b)`` (``b`` the charged tokens) to a window, a median is kept per
  profiled size (sizes with at least ``min_samples`` samples count), and the least-squares line through
  those medians (slope never negative; through the origin while one size is observed, the reference's
  per-token correction) is added to the curve: an offset every step pays plus a slope per token. The
  line is refit after every ``n / REFIT_SHARE`` new residuals (``n`` in the window), so its host cost
  per step stays constant: a full window's line lags by at most that share of it.
  The curve ignores context length, as the reference's does.
- ``sampler_per_row``: the sampler's and verification's seconds per verified row, the windowed median
  of the observed ``sampler_seconds / q`` (0 until ``min_samples`` steps were seen). The reference keeps
  a median of ``sampler_ms`` per batch size; per row it carries over to the sizes not seen yet.
- ``drafting``: the drafter's seconds after a step that drafted for ``r`` requests (0 when ``r`` is 0),
  a line ``per_step + per_request · r`` (``DraftingCost``) through the medians of the observed seconds
  of each request count (0 until ``min_samples`` steps were seen). A drafting step costs something
  whatever its size (a forward for ``mtp`` and ``dspark``, a device-to-host read for every drafter), so
  a median of seconds per request, learned from probes of one request, would charge a step of 16 the
  cost of 16 single ones (measured on the H200: 1.6 ms per request against 0.76 in full steps). It does
  not depend on ``q``, but it is what more verified tokens per step amortize.
- ``host``: the rest of a step's wall time, from the end of the step before to the end of this one, past the
  three measured parts: the host's own work while the device waits (scheduling, the step's inputs, the
  plan, verification and drafting glue launched eagerly, reading the results). A windowed median of it per
  kind of step, those that drafted and those that did not (``host_drafting``, ``host_plain``), charged only
  once both kinds were seen ``min_samples`` times: the plain step's host work is the baseline's too, and one
  kind standing in for the other made drafting look cheaper on the H100 (a drafting step's 3.2–4.4 ms charged
  to the plain step too, whose own was ~3: the gate opened at batch 64 and ran at 0.82× of no speculation,
  0.99× without the term). A gate that drafts at every step sees no plain step: while drafting steps alone
  were seen (``wants_plain_steps``) the speculator lets rounds draft nothing, so the baseline is measured (on
  the H100 at batch 64 the term had stayed uncharged all run: drafting's 4.0 ms of host time against none).
  On the H100 a synchronous spec step's host part was 2.6–4.4 ms against a forward of 3.1–4.0
  (``stats()``). Under an overlapped executor the host's work hides behind the device's, and so the term
  shrinks by itself.

Each observation is first predicted: ``prediction_error`` is the median relative error
``|predicted − measured| / measured`` over the last ``term_window`` steps (``stats()``).
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
from typing import Any, Generic, TypeVar

import torch

from deepinfer.isotonic import pool_adjacent_violators

logger = logging.getLogger(__name__)

REFIT_SHARE = 64  # a RefitWindow's fit is redone once 1/REFIT_SHARE of its window is new
Sample = TypeVar("Sample")
Fit = TypeVar("Fit")


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


class RefitWindow(Generic[Sample, Fit]):
    """The last ``size`` samples and ``fit(samples)``, redone on demand once ``n / REFIT_SHARE`` new
    samples arrived (``n`` in the window): a fit's cost per sample stays constant, and a full window's
    fit lags by at most that share of it."""

    def __init__(self, size: int, fit: Callable[[Sequence[Sample]], Fit]) -> None:
        self.samples: deque[Sample] = deque(maxlen=size)
        self._fit = fit
        self._value: Fit | None = None
        self._since_fit = 0

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        self._since_fit += 1
        if self._since_fit >= max(1, len(self.samples) // REFIT_SHARE):
            self._value = None

    def value(self) -> Fit:
        if self._value is None:
            self._since_fit = 0
            self._value = self._fit(self.samples)
        return self._value


class WindowedMedian(RefitWindow[float, float]):
    """The median of the last ``window`` samples (0.0 until ``min_samples`` arrived), recomputed as
    ``RefitWindow`` refits: sorting a full window after every step cost ~60 µs of a CPU step's host time."""

    def __init__(self, window: int, min_samples: int) -> None:
        super().__init__(window, lambda samples: statistics.median(samples) if len(samples) >= min_samples else 0.0)


def least_squares_line(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of the weighted least-squares line through ``(x, y, weight)`` points, the
    slope never negative (0 when the x do not vary)."""
    total = sum(w for _, _, w in points)
    mx = sum(w * x for x, _, w in points) / total
    my = sum(w * y for _, y, w in points) / total
    var = sum(w * (x - mx) ** 2 for x, _, w in points)
    slope = max(0.0, sum(w * (x - mx) * (y - my) for x, y, w in points) / var) if var else 0.0
    return my - slope * mx, slope


class DraftingCost:
    """Seconds of drafting for ``r`` requests: ``per_step + per_request · r``, the count-weighted least-
    squares line through the median seconds of each observed request count over the last ``window``
    drafting steps (both terms ≥ 0; through the origin while one count was seen; 0 until
    ``min_samples`` steps). Refit after ``n / REFIT_SHARE`` new samples, as the forward's correction."""

    def __init__(self, window: int, min_samples: int) -> None:
        self.min_samples = min_samples
        self._window: RefitWindow[tuple[int, float], tuple[float, float]] = RefitWindow(window, self._fit)

    def add(self, requests: int, seconds: float) -> None:
        self._window.add((requests, seconds))

    def line(self) -> tuple[float, float]:
        """``(per_step, per_request)`` seconds."""
        return self._window.value()

    def _fit(self, samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
        if len(samples) < self.min_samples:
            return 0.0, 0.0
        groups: dict[int, list[float]] = {}
        for requests, seconds in samples:
            groups.setdefault(requests, []).append(seconds)
        points = [(float(r), statistics.median(v), float(len(v))) for r, v in groups.items()]
        through_origin = (0.0, max(0.0, sum(w * x * y for x, y, w in points) / sum(w * x * x for x, _, w in points)))
        if len(points) == 1:
            return through_origin
        intercept, slope = least_squares_line(points)
        return (intercept, slope) if intercept >= 0 else through_origin

    def seconds(self, requests: int) -> float:
        """Drafting seconds after a step that drafts for ``requests`` requests (0: none drafts)."""
        if requests <= 0:
            return 0.0
        per_step, per_request = self.line()
        return per_step + per_request * requests


class StepCost:
    """``StepCostModel`` over a curve that ``measure(query_tokens) -> seconds`` fills on demand, up
    to ``max_tokens``, at ``sizes`` (default ``profile_sizes(max_tokens)``). ``bucketed``: the sizes are
    the CUDA-graph buckets that serve decode steps, so a step is charged as its bucket (padding
    included) instead of interpolated. ``window``: the residuals kept for the slope; ``term_window``: the
    samples kept for the sampler and drafter terms and for the prediction error."""

    def __init__(self, measure: Callable[[int], float], max_tokens: int, *, sizes: Sequence[int] | None = None,
                 bucketed: bool = False, window: int = 5000, term_window: int = 500, min_samples: int = 10) -> None:
        if bucketed and not sizes:
            raise ValueError("StepCost(bucketed=True) needs the graph buckets as sizes")
        self._measure = measure
        self._todo = sorted(sizes) if sizes else profile_sizes(max_tokens)
        self._sizes: list[int] = []
        self._seconds: list[float] = []
        self._fit: list[float] | None = None  # _fitted's cache
        self.bucketed = bucketed
        # (profiled size, charged tokens, seconds − curve) of the observed steps, and the correction line fit to
        # them; the size a step is grouped under is fixed when it is observed (the curve covers it by then)
        self._residuals: RefitWindow[tuple[int, int, float], tuple[float, float]] = RefitWindow(
            window, self._fit_correction)
        self.min_samples = min_samples
        self.sampler_per_row = WindowedMedian(term_window, min_samples)
        self.drafting = DraftingCost(term_window, min_samples)
        self.host_drafting = WindowedMedian(term_window, min_samples)
        self.host_plain = WindowedMedian(term_window, min_samples)
        self.errors = WindowedMedian(term_window, 1)
        self.predicted_steps = 0
        # Called with every point so far after each newly profiled size (the engine's on-disk CurveCache).
        self.on_profiled: Callable[[list[tuple[int, float]]], None] | None = None

    @property
    def sizes(self) -> list[int]:
        """Every query size the curve is profiled at: those profiled so far, then those still to profile."""
        return [*self._sizes, *self._todo]

    @property
    def points(self) -> list[tuple[int, float]]:
        """The sizes profiled so far and their seconds."""
        return list(zip(self._sizes, self._seconds, strict=True))

    def profile_all(self) -> None:
        """Profile every remaining size now (start-up profiling)."""
        while self._todo:
            self._profile_up_to(self._todo[-1])

    def load(self, points: Sequence[tuple[int, float]]) -> None:
        """Take profiled points (e.g. from ``CurveCache``) instead of measuring them; sizes past the last of
        them are still profiled when a step reaches them."""
        self._sizes = [int(q) for q, _ in points]
        self._seconds = [float(t) for _, t in points]
        self._fit = None
        self._todo = [q for q in self._todo if not self._sizes or q > self._sizes[-1]]

    def _profile_up_to(self, query_tokens: int) -> None:
        while self._todo and (not self._sizes or self._sizes[-1] < query_tokens):
            size = self._todo.pop(0)
            self._sizes.append(size)
            self._seconds.append(self._measure(size))
            if self.on_profiled is not None:
                self.on_profiled(self.points)

    def _fitted(self) -> list[float]:
        """The profiled seconds made non-decreasing in the query tokens (pool-adjacent-violators): a
        larger step never costs less, and a point measured slow while the process was still cold (the
        first sizes, on CPU) is pooled with its neighbours instead of making fewer tokens look dearer."""
        if self._fit is None or len(self._fit) != len(self._seconds):
            self._fit = pool_adjacent_violators(self._seconds, [1.0] * len(self._seconds))
        return self._fit

    def curve(self, query_tokens: int) -> float:
        """Profiled seconds at ``query_tokens`` (``_fitted``): linear between profiled sizes, extended
        past the last two, flat below the first."""
        self._profile_up_to(query_tokens)
        sizes, secs = self._sizes, self._fitted()
        if query_tokens <= sizes[0] or len(sizes) == 1:
            return secs[0] if query_tokens <= sizes[0] else secs[0] * query_tokens / sizes[0]
        i = min(bisect.bisect_left(sizes, query_tokens), len(sizes) - 1)
        lo, hi = i - 1, i
        frac = (query_tokens - sizes[lo]) / (sizes[hi] - sizes[lo])
        return secs[lo] + frac * (secs[hi] - secs[lo])

    def charged_tokens(self, query_tokens: int) -> int:
        """The query tokens a step of ``query_tokens`` computes: with graph buckets, the smallest bucket
        ≥ it (padding included); without, or past the largest bucket (an eager step), the tokens themselves."""
        if not self.bucketed:
            return query_tokens
        self._profile_up_to(query_tokens)
        if query_tokens > self._sizes[-1]:
            return query_tokens
        return self._sizes[bisect.bisect_left(self._sizes, query_tokens)]

    def _bucket(self, query_tokens: int) -> int:
        i = bisect.bisect_left(self._sizes, query_tokens)
        return self._sizes[min(i, len(self._sizes) - 1)]

    def _correction(self) -> tuple[float, float]:
        """``(offset, slope)``, the online correction of the forward curve: the least-squares line through
        the medians of the observed residuals ``seconds − curve`` of each profiled size (sizes with at
        least ``min_samples`` samples count; x is their mean charged tokens), its slope never negative.
        With one size observed it is a slope through the origin (the reference's per-token correction).
        An offset keeps a cost that every step pays alike (longer contexts than the profile's, host
        work) from being read as a cost per token, which would make verifying drafts look dear."""
        return self._residuals.value()

    def _fit_correction(self, residuals: Sequence[tuple[int, int, float]]) -> tuple[float, float]:
        groups: dict[int, tuple[list[int], list[float]]] = {}
        for size, charged, r in residuals:  # a plain loop: this runs every few steps on the scheduling thread
            group = groups.get(size)
            if group is None:
                group = groups[size] = ([], [])
            group[0].append(charged)
            group[1].append(r)
        points = [(sum(charged) / len(charged), statistics.median(rs), 1.0)
                  for charged, rs in groups.values() if len(rs) >= self.min_samples]
        if not points:
            return 0.0, 0.0
        if len(points) == 1:
            q, m, _ = points[0]
            return 0.0, max(0.0, m / q)
        return least_squares_line(points)

    def slope(self) -> float:
        """The online per-token correction of the forward curve (seconds per charged token, ≥ 0)."""
        return self._correction()[1]

    def offset(self) -> float:
        """The online per-step correction of the forward curve (seconds, may be negative)."""
        return self._correction()[0]

    def forward_time(self, query_tokens: int) -> float:
        """Seconds of the forward and LM head of a step of ``query_tokens``: the curve and the online
        correction at the charged tokens."""
        charged = self.charged_tokens(query_tokens)
        offset, slope = self._correction()
        return max(0.0, self.curve(charged) + offset + slope * charged)

    def _host(self, requests: int) -> WindowedMedian:
        """The host-time median of a step that drafts for ``requests`` requests: a drafting or a plain step's."""
        return self.host_drafting if requests > 0 else self.host_plain

    def host_seconds(self, requests: int) -> float:
        """The host's seconds a step adds to the measured parts: that of a drafting step (``requests`` > 0) or
        of a plain one, once both kinds were seen ``min_samples`` times (0 before)."""
        if min(len(self.host_drafting.samples), len(self.host_plain.samples)) < self.min_samples:
            return 0.0
        return self._host(requests).value()

    def wants_plain_steps(self) -> bool:
        """Whether the host term waits for plain steps: drafting steps were seen ``min_samples`` times and plain
        ones fewer. A gating plan that drafts at every step would otherwise never learn the baseline's host
        time, and never be charged the drafting steps' own (``Speculator`` then lets a round draft nothing)."""
        return len(self.host_drafting.samples) >= self.min_samples > len(self.host_plain.samples)

    def step_time(self, query_tokens: int, *, requests: int = 0) -> float:
        """Seconds of a decode step of ``query_tokens`` (all verified rows) followed by drafting for
        ``requests`` requests: forward, sampler and verification, drafter, the host's own work."""
        return (self.forward_time(query_tokens) + self.sampler_per_row.value() * query_tokens
                + self.drafting.seconds(requests) + self.host_seconds(requests))

    def step_times(self, query_tokens: torch.Tensor, *, requests: int = 0) -> torch.Tensor:
        """``step_time`` of every size in ``query_tokens`` (int64 ``[N]``, host) at once, float64 ``[N]``."""
        q = query_tokens.to(torch.float64)
        if not len(q):
            return q
        self._profile_up_to(int(query_tokens.max()))
        sizes = torch.tensor(self._sizes, dtype=torch.float64)
        secs = torch.tensor(self._fitted(), dtype=torch.float64)
        charged = q
        if self.bucketed:
            i = torch.searchsorted(sizes, q).clamp(max=len(sizes) - 1)
            charged = torch.where(q > sizes[-1], q, sizes[i])
        if len(sizes) == 1:
            curve = torch.where(charged <= sizes[0], secs[0], secs[0] * charged / sizes[0])
        else:
            hi = torch.searchsorted(sizes, charged).clamp(1, len(sizes) - 1)
            lo = hi - 1
            frac = (charged - sizes[lo]) / (sizes[hi] - sizes[lo])
            curve = torch.where(charged <= sizes[0], secs[0], secs[lo] + frac * (secs[hi] - secs[lo]))
        offset, slope = self._correction()
        forward = (curve + offset + slope * charged).clamp(min=0.0)
        return (forward + self.sampler_per_row.value() * q + self.drafting.seconds(requests)
                + self.host_seconds(requests))

    def observe(self, query_tokens: int, seconds: float, *, sampler_seconds: float | None = None,
                requests: int = 0, draft_seconds: float | None = None, step_seconds: float | None = None) -> None:
        """Learn from a decode step of ``query_tokens``: ``seconds`` of forward and LM head,
        ``sampler_seconds`` of sampling and verification, ``draft_seconds`` of drafting for ``requests``
        requests afterwards, ``step_seconds`` of wall time since the step before ended (None: not measured).
        The step is predicted first (``stats``)."""
        if query_tokens <= 0:
            return
        if requests <= 0:
            draft_seconds = None
        self._record_error(query_tokens, seconds, sampler_seconds, requests, draft_seconds, step_seconds)
        if step_seconds is not None:
            measured = seconds + (sampler_seconds or 0.0) + (draft_seconds or 0.0)
            self._host(requests).add(max(0.0, step_seconds - measured))
        charged = self.charged_tokens(query_tokens)
        residual = seconds - self.curve(charged)  # profiles the curve up to ``charged`` first
        self._residuals.add((self._bucket(charged), charged, residual))
        if sampler_seconds is not None:
            self.sampler_per_row.add(sampler_seconds / query_tokens)
        if draft_seconds is not None:
            self.drafting.add(requests, draft_seconds)

    def _record_error(self, query_tokens: int, seconds: float, sampler_seconds: float | None, requests: int,
                      draft_seconds: float | None, step_seconds: float | None) -> None:
        """The relative error of the model's prediction of the parts of a step that were measured (the whole
        step's wall time when ``step_seconds`` is known)."""
        predicted, measured = self.forward_time(query_tokens), seconds
        if sampler_seconds is not None:
            predicted += self.sampler_per_row.value() * query_tokens
            measured += sampler_seconds
        if draft_seconds is not None:
            predicted += self.drafting.seconds(requests)
            measured += draft_seconds
        if step_seconds is not None:  # the kind's own median, charged or not (0 until min_samples)
            predicted += self._host(requests).value()
            measured = step_seconds
        if measured > 0:
            self.errors.add(abs(predicted - measured) / measured)
            self.predicted_steps += 1

    def stats(self) -> dict[str, float | int]:
        """``get_stats()["step_cost"]``: the median relative error of the step times predicted before
        each observation (over the last ``term_window`` steps) and how many steps were predicted, the
        learned terms and the profiled curve (seconds)."""
        return {
            "prediction_error": self.errors.value(),
            "predicted_steps": self.predicted_steps,
            "offset_seconds": self.offset(),
            "slope_seconds_per_token": self.slope(),
            "sampler_seconds_per_row": self.sampler_per_row.value(),
            "draft_seconds_per_step": self.drafting.line()[0],
            "draft_seconds_per_request": self.drafting.line()[1],
            "host_seconds_drafting": self.host_drafting.value(),
            "host_seconds_plain": self.host_plain.value(),
            "curve_seconds": {str(q): seconds for q, seconds in self.points},  # the profiled forward, by size
        }


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
