"""Scheduling policies: pure decisions over the requests' public view."""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.interfaces import SchedulableRequest


class PriorityPolicy:
    """``SamplingParams.priority``, lower first; first come, first served within a level. The victim
    of a preemption is the least urgent request, the latest arrival among them."""

    def order(self, waiting: Sequence[SchedulableRequest], now: float) -> list[SchedulableRequest]:
        return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))

    def preemption_victim(self, running: Sequence[SchedulableRequest]) -> SchedulableRequest:
        return max(running, key=lambda r: (r.priority, r.arrival_time))


class ShortestPromptFirst:
    """Shortest prompt first (ties by arrival), which lowers mean time to first token when prompt
    lengths vary. The victim is the request with the longest prompt, latest arrival among equals."""

    def order(self, waiting: Sequence[SchedulableRequest], now: float) -> list[SchedulableRequest]:
        return sorted(waiting, key=lambda r: (r.num_prompt_tokens, r.arrival_time))

    def preemption_victim(self, running: Sequence[SchedulableRequest]) -> SchedulableRequest:
        return max(running, key=lambda r: (r.num_prompt_tokens, r.arrival_time))
