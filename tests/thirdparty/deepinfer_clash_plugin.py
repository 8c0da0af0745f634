"""A settings-free third-party plugin (the entry point names this module) whose policy name clashes
with ``deepinfer_sjf_plugin``: both offer ``longest_first``."""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from deepinfer import hookimpl


class ArrivalOrderPolicy:
    """Admit in arrival order, preempt the newest arrival: the core's ``fcfs``, written here because a
    plugin imports only the core's public modules, not ``deepinfer.defaults``."""

    def order(self, waiting: Sequence[Any], now: float) -> list[Any]:
        return sorted(waiting, key=attrgetter("arrival_time"))

    def preemption_victim(self, running: Sequence[Any]) -> Any:
        return max(running, key=attrgetter("arrival_time"))


@hookimpl
def deepinfer_schedule_policies() -> dict[str, ArrivalOrderPolicy]:
    return {"longest_first": ArrivalOrderPolicy()}
