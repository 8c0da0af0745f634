"""Online confidence calibration, per draft position (isotonic over bins).

Raw confidences are binned per position; each bin counts how often a draft that reached
verification was accepted. The calibrated value of a bin is its acceptance rate with a small prior:
at the first position the bin's centre (so unseen bins pass the raw value through), at later
positions the previous position's calibrated value for the same bin — a plan that rarely verifies
deep positions would otherwise never learn them, and conditional acceptance changes slowly with the
position. Each position's values are made non-decreasing in the raw confidence by
pool-adjacent-violators. Drafts never reached (after an earlier rejection)
teach nothing: their outcome was not observed. The table (and its copy on the device) is rebuilt once
``n / REFRESH_SHARE`` new verifications arrived (``n`` so far): the drafter calibrates after every step,
and a rebuild per verification cost more host time than the calibration changes.

``CalibrationError`` reports the expected calibration error of the confidences the plan used:
``Σ_b |Σ confidence − Σ accepted| / N`` over bins of confidence.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

import torch

from deepinfer.interfaces import Drafter, DraftInputs, DraftProposal
from deepinfer.ops import pool_adjacent_violators

PRIOR = 2.0  # pseudo-observations at the bin centre
REFRESH_SHARE = 16  # the table lags the observations by at most 1/16 of them


def _float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (what ``torch.tensor(x, dtype=torch.float32)`` holds)."""
    return struct.unpack("f", struct.pack("f", x))[0]


class IsotonicCalibrator:
    """Per-position binned isotonic calibration of raw confidences in [0, 1]."""

    def __init__(self, max_draft: int, bins: int) -> None:
        self.bins = bins
        self.seen = [[0.0] * bins for _ in range(max_draft)]  # host lists: observed per verify row, per step
        self.accepted = [[0.0] * bins for _ in range(max_draft)]
        self._table: torch.Tensor | None = None
        # ``table()`` where the drafts are, refreshed in place after observations: its address never changes (the
        # core's speculative-tail graphs read it).
        self._on_device: torch.Tensor | None = None
        self._fresh = False
        self._observed = 0  # verifications observed, and since the table was last rebuilt
        self._since_rebuild = 0

    def _bin(self, raw: torch.Tensor) -> torch.Tensor:
        return (raw.to(torch.float64) * self.bins).long().clamp(0, self.bins - 1)

    def table(self) -> torch.Tensor:
        """``[max_draft, bins]`` calibrated value of each bin."""
        if self._table is None:
            prior = ((torch.arange(self.bins, dtype=torch.float64) + 0.5) / self.bins).tolist()
            rows = []
            for seen, accepted in zip(self.seen, self.accepted, strict=True):
                rates = [(a + PRIOR * p) / (n + PRIOR) for a, n, p in zip(accepted, seen, prior, strict=True)]
                prior = pool_adjacent_violators(rates, [n + PRIOR for n in seen])
                rows.append(prior)
            self._table = torch.tensor(rows, dtype=torch.float64)
        return self._table

    def calibrate(self, raw: torch.Tensor) -> torch.Tensor:
        """``[B, k]`` raw → calibrated float32, on ``raw``'s device without reading it (drafting runs on the
        device between steps); the table is copied there once per change."""
        if not raw.numel():
            return raw.float()
        table = self.refresh(raw.device)
        k = raw.shape[1]
        return table[:k].gather(1, self._bin(raw).t()).t()

    def refresh(self, device: torch.device | None = None) -> torch.Tensor | None:
        """The table's copy on ``device`` (None: where it is already; nothing before the first calibration),
        brought up to date in place when observations changed it."""
        if device is None:
            if self._on_device is None:
                return None
            device = self._on_device.device
        if self._on_device is None or self._on_device.device != device:
            self._on_device = torch.empty(self.table().shape, dtype=torch.float32, device=device)
            self._fresh = False
        if not self._fresh:
            table = self.table().float()  # float32 where the drafts are: the lookup is then the result
            self._on_device.copy_(table.pin_memory() if device.type == "cuda" else table, non_blocking=True)
            self._fresh = True
        return self._on_device

    def observe(self, raw: Sequence[float], verified: int, accepted: int) -> None:
        """One request's verification: drafts ``0..verified-1`` with raw confidences ``raw``, the first
        ``accepted`` of them accepted; positions past the first rejection were not observed."""
        observed = min(verified, accepted + 1, len(self.seen))
        # ``_bin`` on the host, value by value (a few per request and step: tensors would cost more): rounded to
        # float32 as the drafts' confidences are, then × bins in float64, truncated and clamped.
        bins = [min(max(int(_float32(x) * self.bins), 0), self.bins - 1) for x in raw[:observed]]
        for j, b in enumerate(bins):
            self.seen[j][b] += 1
            self.accepted[j][b] += float(j < accepted)
        self._observed += 1
        self._since_rebuild += 1
        if self._since_rebuild >= max(1, self._observed // REFRESH_SHARE):
            self._table = None
            self._fresh = False
            self._since_rebuild = 0


class CalibratedDrafter:
    """Wraps a drafter: its confidences are calibrated, the raw ones kept alongside."""

    def __init__(self, inner: Drafter, calibrator: IsotonicCalibrator) -> None:
        self.inner = inner
        self.calibrator = calibrator
        # ``interfaces.GraphDrafter``: capturable when the inner drafter is (the calibration reads its table).
        self.graph_capturable = bool(getattr(inner, "graph_capturable", False))

    def settle(self) -> None:
        """Bring the calibration table on the device up to date, then the inner drafter's deferred work."""
        self.calibrator.refresh()
        settle = getattr(self.inner, "settle", None)
        if settle is not None:
            settle()

    def propose(self, inputs: DraftInputs) -> DraftProposal:
        proposal = self.inner.propose(inputs)
        if not proposal.tokens.shape[0]:  # nobody drafted (every request paused): nothing to calibrate
            return proposal
        raw = proposal.confidence
        calibrated = self.calibrator.calibrate(raw.float())
        calibrated = calibrated.masked_fill(proposal.tokens < 0, 0.0)
        return dataclasses.replace(proposal, confidence=calibrated, raw_confidence=raw)


class CalibrationError:
    """Expected calibration error of (confidence, accepted) pairs, accumulated over a run."""

    def __init__(self, bins: int = 10) -> None:
        self.bins = bins
        self.confidence = [0.0] * bins
        self.accepted = [0.0] * bins
        self.count = 0

    def observe(self, confidence: Sequence[float], verified: int, accepted: int) -> None:
        for j in range(min(verified, accepted + 1)):
            b = min(int(confidence[j] * self.bins), self.bins - 1)
            self.confidence[b] += confidence[j]
            self.accepted[b] += float(j < accepted)
            self.count += 1

    def value(self) -> float:
        if not self.count:
            return 0.0
        return sum(abs(c - a) for c, a in zip(self.confidence, self.accepted, strict=True)) / self.count
