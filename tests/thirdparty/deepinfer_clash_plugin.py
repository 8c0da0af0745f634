"""A settings-free third-party plugin (the entry point names this module) whose policy name clashes
with ``deepinfer_sjf_plugin``: both offer ``longest_first``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer import hookimpl


class NewestFirstPolicy:
    """Admit the latest arrival first, preempt the earliest; only its name matters (it clashes)."""

    def order(self, waiting: Sequence[Any], now: float) -> list[Any]:
        return sorted(waiting, key=lambda request: -request.arrival_time)

    def preemption_victim(self, running: Sequence[Any]) -> Any:
        return min(running, key=lambda request: request.arrival_time)


@hookimpl
def deepinfer_schedule_policies() -> dict[str, NewestFirstPolicy]:
    return {"longest_first": NewestFirstPolicy()}
