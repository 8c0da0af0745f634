"""The plugin's config section: ``plugins.attention``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class AttentionConfig(BaseModel):
    """``plugins={"attention": {"enabled": True, ...}}``."""

    model_config = ConfigDict(extra="forbid")
