"""The plugin's config section: ``plugins.scheduling``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class SchedulingConfig(BaseModel):
    """``plugins={"scheduling": {"enabled": True}}`` offers the ``overlap`` executor (chosen by
    ``scheduler.executor: auto``) and the ``priority`` and ``spf`` policies (``scheduler.policy``)."""

    model_config = ConfigDict(extra="forbid")
