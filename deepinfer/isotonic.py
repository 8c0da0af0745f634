"""Isotonic regression by pool-adjacent-violators: the non-decreasing fit the step-cost curve
(``engine/cost.py``) and the speculative-decoding calibration (``plugins/spec_decode``) both use."""

from __future__ import annotations

from collections.abc import Sequence


def pool_adjacent_violators(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least squares."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    out: list[float] = []
    for mean, _, count in blocks:
        out.extend([mean] * int(count))
    return out
