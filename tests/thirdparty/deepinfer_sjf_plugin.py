"""A third-party scheduling plugin, deliberately outside the deepinfer package.

It offers the policy ``longest_first``: admit the waiting request with the longest prompt first
(``reverse: true`` admits the shortest first), and preempt the running request that policy would
admit last. It also observes the engine (steps, finished requests) and reports counters through
``deepinfer_stats``, so tests can see every kind of hook reach a plugin that deepinfer never imports
by name. The test suite installs it through an entry point in the group ``deepinfer.plugins``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from deepinfer import hookimpl


class SJFConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reverse: bool = False


class LongestFirstPolicy:
    """Admit by prompt length, longest first (ties: earliest arrival); preempt the one admitted last."""

    def __init__(self, reverse: bool) -> None:
        self.reverse = reverse

    def _key(self, request: Any) -> tuple[int, float]:
        length = request.num_prompt_tokens
        return (length if self.reverse else -length, request.arrival_time)

    def order(self, waiting: Sequence[Any], now: float) -> list[Any]:
        return sorted(waiting, key=self._key)

    def preemption_victim(self, running: Sequence[Any]) -> Any:
        return max(running, key=self._key)


class Plugin:
    """Entry point ``sjf = deepinfer_sjf_plugin:Plugin``."""

    config_model = SJFConfig

    def __init__(self, config: SJFConfig) -> None:
        self.config = config
        self.started_info: Any = None
        self.stopped = False
        self.steps = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.finished_prompt_lens: list[int] = []

    @staticmethod
    @hookimpl
    def deepinfer_config_aliases() -> dict[str, str]:
        return {"DEEPINFER_SJF_REVERSE": "plugins.sjf.reverse"}

    @hookimpl
    def deepinfer_schedule_policies(self) -> dict[str, LongestFirstPolicy]:
        return {"longest_first": LongestFirstPolicy(self.config.reverse)}

    @hookimpl
    def deepinfer_engine_started(self, info: Any) -> None:
        self.started_info = info

    @hookimpl
    def deepinfer_engine_stopping(self) -> None:
        self.stopped = True

    @hookimpl
    def deepinfer_step_end(self, stats: Any) -> None:
        self.steps += 1
        self.prefill_tokens += stats.num_prefill_tokens
        self.decode_tokens += stats.num_decode_tokens

    @hookimpl
    def deepinfer_request_end(self, output: Any) -> None:
        self.finished_prompt_lens.append(len(output.prompt_token_ids))

    @hookimpl
    def deepinfer_stats(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "requests_finished": len(self.finished_prompt_lens),
            "finished_prompt_lens": list(self.finished_prompt_lens),
        }
