"""A test plugin that slows the engine down: it sleeps ``sleep_ms`` in every ``deepinfer_step_end``.

It changes no token, so an A/B run of ``plugins.slow.enabled=false`` against ``true`` must find B
slower while the outputs stay token-identical. Installed through an entry point in the group
``deepinfer.plugins`` (``slow = deepinfer_slow_plugin:Plugin``).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from deepinfer import hookimpl


class SlowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sleep_ms: float = 5.0


class Plugin:
    config_model = SlowConfig

    def __init__(self, config: SlowConfig) -> None:
        self.config = config
        self.sleeps = 0

    @hookimpl
    def deepinfer_step_end(self, stats: Any) -> None:
        time.sleep(self.config.sleep_ms / 1000)
        self.sleeps += 1

    @hookimpl
    def deepinfer_stats(self) -> dict[str, Any]:
        return {"sleeps": self.sleeps}
