"""A third-party plugin whose observer hook raises, in the hook its config names."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from deepinfer import hookimpl


class FaultyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fail_in: Literal["step_end", "request_end", "stats"] = "step_end"


class FaultyPluginBug(RuntimeError):
    pass


class Plugin:
    config_model = FaultyConfig

    def __init__(self, config: FaultyConfig) -> None:
        self.config = config

    def _maybe_fail(self, where: str) -> None:
        if self.config.fail_in == where:
            raise FaultyPluginBug(f"deliberate failure in {where}")

    @hookimpl
    def deepinfer_step_end(self, stats: Any) -> None:
        self._maybe_fail("step_end")

    @hookimpl
    def deepinfer_request_end(self, output: Any) -> None:
        self._maybe_fail("request_end")

    @hookimpl
    def deepinfer_stats(self) -> dict[str, int]:
        self._maybe_fail("stats")
        return {"calls": 1}
