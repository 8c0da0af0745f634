"""When to rebalance (reference/deepinfer.md §7: the first rearrangement after ``max(1, interval // 4)``
steps, then every ``interval`` steps; ``interval`` 0 never)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RebalanceSchedule:
    """``due(step)`` for ``step`` = lock-steps completed so far (1 after the first)."""

    interval: int
    window: int

    @property
    def first(self) -> int:
        return max(1, self.interval // 4)

    def due(self, step: int) -> bool:
        if self.interval <= 0 or step < self.first:
            return False
        return (step - self.first) % self.interval == 0
