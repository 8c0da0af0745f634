"""The plugin's config section: ``plugins.eplb``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EPLBConfig(BaseModel):
    """``plugins={"eplb": {"enabled": True}}`` rebalances experts with ``greedy_multistep`` every
    ``interval`` steps (the first time after ``max(1, interval // 4)``) from the last ``window`` steps
    of router statistics, with ``num_redundant_experts`` extra slots (rounded up by the core so that
    every rank holds as many). ``interval: 0`` keeps the initial placement (statistics are still kept).
    ``policy`` names any offered placement policy (this plugin's, or another plugin's, which then
    brings its own window, schedule and redundancy)."""

    model_config = ConfigDict(extra="forbid")

    policy: str = "greedy_multistep"
    interval: int = Field(default=1000, ge=0)
    window: int = Field(default=100, ge=1)
    num_redundant_experts: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _window_within_interval(self) -> EPLBConfig:
        if self.interval and self.window > self.interval:
            raise ValueError(f"window ({self.window}) must be in [1, interval={self.interval}] "
                             "(reference/deepinfer.md §7)")
        return self
