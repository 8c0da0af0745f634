"""The plugin's face: its config model and hookimpls."""

from __future__ import annotations

from typing import Any

from deepinfer import hookimpl
from deepinfer.errors import ConfigError
from deepinfer.interfaces import EngineInfo, StepContext
from deepinfer_scheduling.config import SchedulingConfig
from deepinfer_scheduling.overlap import OverlapExecutor
from deepinfer_scheduling.policies import PriorityPolicy, ShortestPromptFirst
from deepinfer_scheduling.sync_guard import SyncGuard


class Plugin:
    """Offers the ``overlap`` executor and the ``priority`` and ``spf`` policies."""

    config_model = SchedulingConfig

    def __init__(self, config: SchedulingConfig) -> None:
        self.config = config
        self.executors: list[OverlapExecutor] = []

    @staticmethod
    def deepinfer_config_aliases() -> dict[str, str]:
        return {"DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "plugins.scheduling.enabled"}

    @hookimpl
    def deepinfer_validate_config(self, config: Any, info: EngineInfo) -> None:
        if self.config.launch == "inline" and info.device != "cuda":
            raise ConfigError(
                f"plugins.scheduling.launch='inline' needs a CUDA device (the engine's is {info.device!r}): the host "
                "thread would run each step's forward itself and overlap nothing; use 'thread'")

    def _overlap(self, context: StepContext) -> OverlapExecutor:
        executor = OverlapExecutor(context, SyncGuard(self.config.sync_guard), inline=self.config.launch == "inline")
        self.executors.append(executor)
        return executor

    @hookimpl
    def deepinfer_step_executors(self) -> dict[str, Any]:
        return {"overlap": self._overlap}

    @hookimpl
    def deepinfer_schedule_policies(self) -> dict[str, Any]:
        return {"priority": PriorityPolicy(), "spf": ShortestPromptFirst()}

    @hookimpl
    def deepinfer_stats(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for executor in self.executors:
            for key, value in executor.timeline.stats().items():
                merged[key] = merged.get(key, 0.0) + value
        if "device_busy_s" in merged:  # some worker ran steps (launch="thread")
            busy, idle = merged["device_busy_s"], merged["device_idle_s"]
            merged["device_idle_fraction"] = idle / (busy + idle) if busy + idle else 0.0
        return merged

    @hookimpl
    def deepinfer_engine_stopping(self) -> None:
        for executor in self.executors:
            executor.shutdown()
