"""The plugin's config section: ``plugins.spec_decode``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SpecDecodeConfig(BaseModel):
    """``plugins={"spec_decode": {"enabled": True, ...}}``.

    ``drafter``: ``auto`` (``mtp`` when the model has MTP layers, else ``ngram``), ``mtp`` (DeepSeek-V3's
    MTP layer, chained; the checkpoint must carry its weights), ``ngram``, ``oracle`` or a third party's
    name. ``plan``: ``varlen`` (confidence-driven), ``fixed`` or a third party's;
    the reference's ``DEEPINFER_ENABLE_MTP_VARLEN`` maps 1/0 onto varlen/fixed. ``max_draft``: drafts
    proposed per request per step (the reference's ``DEEPINFER_USE_NEXTN_DECODE``).
    ``ngram_min``/``ngram_max``: the n-gram lengths prompt lookup tries, longest first.
    ``oracle_file``: JSONL of ``{"token_ids": [...]}`` known sequences for the test drafter;
    ``oracle_corruption``: the rate at which it plants a wrong draft; ``oracle_draft_probs``: draw
    drafts from a smoothed distribution and report it (exercises the non-one-hot path).
    ``calibration``: ``isotonic`` (per position, online) or ``off``; ``calibration_bins``.
    """

    model_config = ConfigDict(extra="forbid")

    drafter: str = "auto"
    plan: str = "varlen"
    max_draft: int = Field(default=5, ge=1, le=32)
    ngram_min: int = Field(default=2, ge=1)
    ngram_max: int = Field(default=4, ge=1)
    oracle_file: str | None = None
    oracle_corruption: float = Field(default=0.2, ge=0.0, le=1.0)
    oracle_draft_probs: bool = False
    calibration: Literal["isotonic", "off"] = "isotonic"
    calibration_bins: int = Field(default=10, ge=1, le=1000)

    @field_validator("plan", mode="before")
    @classmethod
    def _varlen_switch(cls, value: Any) -> Any:
        """``DEEPINFER_ENABLE_MTP_VARLEN=1`` arrives as an int or bool."""
        if isinstance(value, bool | int) and not isinstance(value, str):
            return "varlen" if value else "fixed"
        return value

    @model_validator(mode="after")
    def _ngram_range(self) -> SpecDecodeConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        return self
