"""Cumulative engine counters behind ``LLM.get_stats()``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("schedule", "prepare", "forward", "sample", "process")


@dataclass
class EngineStats:
    """Totals since start; ``phase_seconds`` accumulates the time split of every step."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # On CUDA, from events around each step: time the device ran steps, and the gaps between them.
    device_busy_s: float = 0.0
    device_idle_s: float = 0.0


class StepTimer:
    """Times the phases of one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0
