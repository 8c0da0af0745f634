"""The plugin's counters, shown by ``LLM.get_stats()["spec_decode"]`` (API.md §4)."""

from __future__ import annotations

from deepinfer.interfaces import StepStats
from deepinfer_spec_decode.calibration import CalibrationError


class SpecStats:
    """Accumulated from ``StepStats``: acceptance per verify, per position, and calibration."""

    def __init__(self, max_draft: int) -> None:
        self.verifies = 0
        self.emitted = 0
        self.verified_at = [0] * max_draft
        self.accepted_at = [0] * max_draft
        self.decode_steps = 0
        self.decode_tokens = 0
        self.calibration = CalibrationError()

    def observe(self, stats: StepStats) -> None:
        if stats.num_decode_tokens:
            self.decode_steps += 1
            self.decode_tokens += stats.num_decode_tokens
        for v, a, conf in zip(stats.verified_drafts, stats.accepted_drafts, stats.draft_confidence, strict=True):
            self.verifies += 1
            self.emitted += a + 1
            for j in range(min(v, len(self.verified_at))):
                self.verified_at[j] += 1
                self.accepted_at[j] += int(j < a)
            self.calibration.observe(conf, v, a)

    def as_dict(self) -> dict[str, float | list[float]]:
        return {
            "mean_acceptance_length": self.emitted / self.verifies if self.verifies else 0.0,
            "acceptance_per_position": [a / v if v else 0.0 for a, v in zip(self.accepted_at, self.verified_at,
                                                                              strict=True)],
            "verified_tokens_per_step": self.decode_tokens / self.decode_steps if self.decode_steps else 0.0,
            "confidence_calibration_error": self.calibration.value(),
            "verify_steps": self.verifies,
        }
