"""The plugin's config section: ``plugins.attention``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ReplayConfig(BaseModel):
    """``plugins.attention.replay``: the ``bounded`` replay planner (README.md, ``replay.py``).

    ``mode``: YoCo prefill truncation, ``off``, ``mask`` or ``compact`` (the reference's
    ``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE``); ``keep_tokens``: the prompt suffix the consumer layers
    compute, and the tokens a bounded restore replays (``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``; at least
    the widest window + ``cache.max_backtrack`` when used, checked at start-up); ``restore``: ``exact``
    (the receptive field, as the core's ``exact`` planner) or ``bounded`` (the last ``keep_tokens``)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["off", "mask", "compact"] = "off"
    keep_tokens: int = Field(default=140, ge=0)
    restore: Literal["exact", "bounded"] = "exact"

    @field_validator("mode", mode="before")
    @classmethod
    def _env_off(cls, value: Any) -> Any:
        """``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=off`` reads as YAML false."""
        return "off" if value is False else value


class AttentionConfig(BaseModel):
    """``plugins={"attention": {"enabled": True, ...}}``."""

    model_config = ConfigDict(extra="forbid")

    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    triton_max_query_len: int = Field(16, ge=1, description=(
        "backends triton / triton_mla / triton_v4 / flash_mla: requests with at most this many query tokens in a step "
        "(decode, speculative verification) run through the decode kernels; longer ones (prefill chunks) through "
        "triton's prefill kernel (triton), the core's torch reference (triton_mla, flash_mla) or, for triton_v4, "
        "the same kernels (there the bound only marks the steps that read no host list)"))
