"""The plugin's config section: ``plugins.spec_decode``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SpecDecodeConfig(BaseModel):
    """``plugins={"spec_decode": {"enabled": True, ...}}``.

    ``drafter``: ``auto`` (``mtp`` when the model has MTP layers, else ``ngram``), ``mtp`` (DeepSeek-V3's
    MTP layer, chained; the checkpoint must carry its weights), ``dspark`` (the block drafter, below),
    ``ngram``, ``oracle`` or a third party's name. ``plan``: ``fixed`` (the default, as in the
    reference: no measurement has ``varlen`` ahead everywhere yet, docs/benchmarks.md), ``varlen``
    (confidence-driven) or a third party's; the reference's ``DEEPINFER_ENABLE_MTP_VARLEN`` maps 1/0 onto
    varlen/fixed, and ``DEEPINFER_USE_NEXTN_DECODE=k`` alone enables the plugin with ``k`` drafts.
    ``max_draft``: drafts proposed per request per step (the reference's ``DEEPINFER_USE_NEXTN_DECODE``);
    0 turns drafting off (the plugin stays enabled, the engine decodes without speculation).
    ``ngram_min``/``ngram_max``: the n-gram lengths prompt lookup tries, longest first.
    ``oracle_file``: JSONL of ``{"token_ids": [...]}`` known sequences for the test drafter;
    ``oracle_corruption``: the rate at which it plants a wrong draft; ``oracle_draft_probs``: draw
    drafts from a smoothed distribution and report it (exercises the non-one-hot path).
    ``calibration``: ``isotonic`` (per position, online) or ``off``; ``calibration_bins``.

    The ``dspark`` block drafter (``dspark.py``, reference/deepinfer.md §4; its block is ``max_draft``
    tokens): ``dspark_target_layer_ids`` the main-model layers whose inputs are its features (None:
    layers 1, the middle one and the last); ``dspark_num_layers``, ``dspark_num_heads`` and
    ``dspark_intermediate_size`` (None: 2 × hidden) its blocks; ``dspark_context_window`` the committed
    rows (the last ones of the request) whose projected target keys and values every block row attends
    to (the reference's drafter SWA window); ``dspark_markov_rank`` the rank of the
    first-order Markov correction; ``dspark_noise_token_id`` the filler of the block after the last
    token (None: the last vocabulary id); ``dspark_confidence_temperature`` the sigmoid temperature of
    the confidence head, one value or one per draft position (the reference's
    ``DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE``, a comma list); ``dspark_weights``: ``auto`` (the
    drafter trained for this target by ``deepinfer train-drafter``'s default recipe, cached under
    ``$DEEPINFER_CACHE_DIR/drafters``; trained on first use, with a progress bar), a safetensors file in
    the README's layout, or ``random`` (weights from the engine seed: acceptance near zero; for tests and
    mechanism benchmarks); ``dspark_auto_recipe`` overrides fields of the recipe ``auto`` trains with
    (``drafter_training.Recipe``: e.g. ``{"prompts": 200, "steps": 1000}``; part of the cache key).
    ``dspark_n_routed_experts`` (0: dense blocks) and ``dspark_num_experts_per_tok`` make every block's MLP
    a MoE as the reference's (its dense MLP the shared expert, plus that many routed experts of
    ``dspark_intermediate_size``, the top ``dspark_num_experts_per_tok`` per row); ``dspark_target_attn_input``
    (the reference's; only ``True``): the features are the residual entering each target layer's
    attention, on a model with hyper-connections (DeepSeek-V4) the mean of its streams there.
    ``dspark_dtype``: the drafter's weights, context cache and activations (``auto``: the target's dtype;
    ``bfloat16`` halves the bytes a drafting step reads, e.g. beside a float32 target on CPU; drafts are
    verified by the target either way, so the output is unchanged).
    """

    model_config = ConfigDict(extra="forbid")

    drafter: str = "auto"
    plan: str = "fixed"
    max_draft: int = Field(default=5, ge=0, le=32)
    ngram_min: int = Field(default=2, ge=1)
    ngram_max: int = Field(default=4, ge=1)
    oracle_file: str | None = None
    oracle_corruption: float = Field(default=0.2, ge=0.0, le=1.0)
    oracle_draft_probs: bool = False
    calibration: Literal["isotonic", "off"] = "isotonic"
    calibration_bins: int = Field(default=10, ge=1, le=1000)
    dspark_target_layer_ids: list[int] | None = None
    dspark_num_layers: int = Field(default=1, ge=1)
    dspark_context_window: int = Field(default=16, ge=1)
    dspark_num_heads: int = Field(default=4, ge=1)
    dspark_intermediate_size: int | None = Field(default=None, ge=1)
    dspark_n_routed_experts: int = Field(default=0, ge=0)
    dspark_num_experts_per_tok: int | None = Field(default=None, ge=1)
    dspark_target_attn_input: bool = True
    dspark_markov_rank: int = Field(default=32, ge=1)
    dspark_noise_token_id: int | None = Field(default=None, ge=0)
    dspark_confidence_temperature: float | list[float] = 1.0
    dspark_weights: str = "auto"
    dspark_auto_recipe: dict[str, Any] | None = None
    dspark_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    @field_validator("dspark_confidence_temperature", mode="before")
    @classmethod
    def _temperature_list(cls, value: Any) -> Any:
        """``DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE`` may be a comma list (one per draft position)."""
        if isinstance(value, str):
            try:
                values = [float(v) for v in value.split(",")]
            except ValueError:
                raise ValueError(f"expected a number or a comma list of numbers, got {value!r}") from None
            return values[0] if len(values) == 1 else values
        return value

    @model_validator(mode="after")
    def _ngram_range(self) -> SpecDecodeConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        return self

    @model_validator(mode="after")
    def _dspark_experts(self) -> SpecDecodeConfig:
        experts, top_k = self.dspark_n_routed_experts, self.dspark_num_experts_per_tok
        if experts and top_k is None:
            raise ValueError(f"dspark_num_experts_per_tok must be set (1 to {experts}) when dspark_n_routed_experts "
                             f"is {experts}")
        if not experts and top_k is not None:
            raise ValueError(f"dspark_num_experts_per_tok ({top_k}) needs dspark_n_routed_experts > 0 (MoE blocks)")
        if top_k is not None and top_k > experts:
            raise ValueError(f"dspark_num_experts_per_tok ({top_k}) must be at most dspark_n_routed_experts "
                             f"({experts})")
        if not self.dspark_target_attn_input:
            raise ValueError("dspark_target_attn_input must be true: the features are the residual entering each "
                             "target layer's attention (the reference supports attention-input targets only)")
        return self

    @model_validator(mode="after")
    def _dspark_temperatures(self) -> SpecDecodeConfig:
        temps = self.dspark_confidence_temperature
        values = temps if isinstance(temps, list) else [temps]
        if any(t <= 0 for t in values):
            raise ValueError(f"dspark_confidence_temperature values must be > 0, got {temps}")
        if isinstance(temps, list) and len(temps) != self.max_draft:
            raise ValueError(f"dspark_confidence_temperature has {len(temps)} values; a list needs one per draft "
                             f"position (max_draft = {self.max_draft})")
        return self
