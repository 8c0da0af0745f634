"""A/B statistics: the B/A ratio of medians with a percentile-bootstrap confidence interval.

Each resample draws A and B independently with replacement (their own sample sizes), takes the
ratio of the two medians, and the interval is the (α/2, 1 − α/2) percentiles of those ratios. The
generator is seeded (``numpy.random.default_rng(seed)``), so a report is reproducible from its
samples. A verdict is given only when the interval excludes 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0


@dataclass
class RatioCI:
    ratio: float  # median(B) / median(A)
    low: float
    high: float
    confidence: float

    @property
    def excludes_one(self) -> bool:
        return self.low > 1.0 or self.high < 1.0


def bootstrap_median_ratio(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95,
                           resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> RatioCI:
    """median(b) / median(a) with a bootstrap ``confidence`` interval (fixed ``seed``)."""
    xa = np.asarray(a, dtype=np.float64)
    xb = np.asarray(b, dtype=np.float64)
    if xa.size == 0 or xb.size == 0:
        raise ValueError("bootstrap needs at least one sample on each side")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    rng = np.random.default_rng(seed)
    ma = np.median(xa[rng.integers(0, xa.size, (resamples, xa.size))], axis=1)
    mb = np.median(xb[rng.integers(0, xb.size, (resamples, xb.size))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = mb / ma
    ratios = ratios[np.isfinite(ratios)]
    point = float(np.median(xb) / np.median(xa)) if np.median(xa) != 0 else float("nan")
    if ratios.size == 0:
        return RatioCI(point, float("nan"), float("nan"), confidence)
    alpha = 1 - confidence
    low, high = np.quantile(ratios, [alpha / 2, 1 - alpha / 2])
    return RatioCI(point, float(low), float(high), confidence)


def verdict(ci: RatioCI, higher_is_better: bool) -> str | None:
    """``"B better"`` / ``"B worse"`` when the interval excludes 1, else ``None`` (no verdict)."""
    if not ci.excludes_one:
        return None
    b_higher = ci.low > 1.0
    return "B better" if b_higher == higher_is_better else "B worse"


def compare(name: str, a: Sequence[float], b: Sequence[float], *, higher_is_better: bool, unit: str = "",
            confidence: float = 0.95, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED
            ) -> dict[str, Any]:
    """One row of the ``metrics`` list of the A/B report."""
    ci = bootstrap_median_ratio(a, b, confidence=confidence, resamples=resamples, seed=seed)
    return {
        "name": name,
        "unit": unit,
        "higher_is_better": higher_is_better,
        "a_median": float(np.median(a)),
        "b_median": float(np.median(b)),
        "ratio": ci.ratio,
        "ci_low": ci.low,
        "ci_high": ci.high,
        "verdict": verdict(ci, higher_is_better),
        "a_samples": [float(x) for x in a],
        "b_samples": [float(x) for x in b],
    }
