"""Request-level metrics as the peers define them (``vllm bench serve``), from per-chunk timelines.

A request's timeline is the time it entered the engine and the time of every streamed chunk (one
chunk per engine step that gave it tokens; with speculative decoding a chunk may carry several):

- TTFT: first chunk − start;  E2EL: last chunk − start;
- TPOT: (E2EL − TTFT) / (output tokens − 1), per request (requests with one token have none);
- ITL: every gap between consecutive chunks of a request, pooled over requests;
- throughput: requests, output tokens and all tokens per second of the run's wall time;
- per-user tok/s: the median over requests of (output tokens − 1) / (E2EL − TTFT), the decode speed
  one user sees (the x axis of the Pareto plot);
- mean acceptance length: output tokens after the first chunk / chunks after the first (1.0 without
  speculation; tokens per verify step, bonus included, with it).

Latencies are reported in milliseconds as mean, median, p90 and p99 (linear interpolation).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


@dataclass
class RequestRecord:
    """One request's timeline (seconds on one monotonic clock) and its output tokens."""

    prompt_len: int
    start: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, median, p90, p99 (and std, min, max) of ``values × scale``; ``None`` when empty."""
    if not values:
        return dict.fromkeys(("mean", "median", "p90", "p99", "std", "min", "max"))
    a = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "std": float(a.std()),
        "min": float(a.min()),
        "max": float(a.max()),
    }


def output_digest(token_ids: Sequence[Sequence[int]]) -> str:
    """A SHA-256 of every request's output ids, in workload order: equal digests ⇔ identical tokens."""
    return hashlib.sha256(json.dumps([list(t) for t in token_ids]).encode()).hexdigest()


def step_split(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """Seconds per phase spent during a run (the difference of two ``step_time_split`` readings)."""
    seconds = {k: float(after.get(k, 0.0)) - float(before.get(k, 0.0)) for k in after}
    total = sum(seconds.values())
    return {"seconds": seconds, "fraction": {k: (v / total if total > 0 else 0.0) for k, v in seconds.items()}}


def compute_metrics(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """The metrics object of one run (see ``docs/bench.md`` for the schema)."""
    done = [r for r in records if r.chunk_times]
    n_out = [r.num_output_tokens for r in done]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(n_out)
    tpots = [t for r in done if (t := r.tpot) is not None]
    itls = [g for r in done for g in r.itls]
    rates = [(r.num_output_tokens - 1) / (r.e2el - r.ttft) for r in done
             if r.num_output_tokens > 1 and r.e2el > r.ttft]
    later_chunks = sum(len(r.chunk_times) - 1 for r in done)
    later_tokens = sum(r.num_output_tokens - r.chunk_tokens[0] for r in done)
    safe = duration if duration > 0 else math.nan
    return {
        "num_requests": len(done),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / safe,
        "output_throughput": total_out / safe,
        "total_token_throughput": (total_in + total_out) / safe,
        "per_user_output_throughput": float(np.median(rates)) if rates else None,
        "ttft_ms": summarize([r.ttft for r in done], 1e3),
        "tpot_ms": summarize(tpots, 1e3),
        "itl_ms": summarize(itls, 1e3),
        "e2el_ms": summarize([r.e2el for r in done], 1e3),
        "mean_acceptance_length": later_tokens / later_chunks if later_chunks else None,
    }


def acceptance_normalized_throughput(run: Mapping[str, Any], assumed_acceptance: float, max_draft: int) -> float:
    """A labelled extra, never a headline, normalized the way the reference reports fixed-``k``
    speculative throughput: the run's steps counted as if every draft were accepted (``1 + k`` tokens
    per verify step), scaled by ``(1 + k·a) / (1 + k)`` — i.e. ``1 + k·a`` tokens per verify step at
    ``a = assumed_acceptance``. A run's measured tokens per step (``mean_acceptance_length``) give its
    steps per second."""
    if not 0 <= assumed_acceptance <= 1:
        raise ValueError(f"--assumed-acceptance must be in [0, 1], got {assumed_acceptance}")
    measured = run.get("mean_acceptance_length") or 1.0
    return run["output_throughput"] / measured * (1 + max_draft * assumed_acceptance)


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Raw per-request latencies in ms (for CDF plots and the ``samples`` field of a run)."""
    done = [r for r in records if r.chunk_times]
    return {
        "ttft_ms": [r.ttft * 1e3 for r in done],
        "tpot_ms": [t * 1e3 for r in done if (t := r.tpot) is not None],
        "itl_ms": [g * 1e3 for r in done for g in r.itls],
        "e2el_ms": [r.e2el * 1e3 for r in done],
    }
