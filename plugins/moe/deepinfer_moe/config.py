"""The plugin's config section: ``plugins.moe``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MoEConfig(BaseModel):
    """``plugins={"moe": {"enabled": True}}`` offers the MoE backends ``grouped``, ``triton``,
    ``triton_fp8``, ``deep_gemm``; pick one
    with ``kernels.moe`` or let ``auto`` take the highest-priority one that fits the run."""

    model_config = ConfigDict(extra="forbid")

    auto_fp8: bool = Field(False, description=(
        "let kernels.moe=auto choose an FP8 backend (deep_gemm, then triton_fp8) over bf16 triton; off by "
        "default because FP8 changes the model's numbers"))
    decode_max_tokens: int = Field(4, ge=0, description=(
        "triton: steps with at most this many tokens use the decode layout (one block per token-expert "
        "pair, no sort)"))
    fused_router: bool = Field(True, description=(
        "triton, triton_fp8: route DeepSeek-style MoE layers (sigmoid/softmax scores, bias, group limit, "
        "top-k, renormalization, balanced draw) in one fused kernel per layer, up to 256 experts; off: the "
        "model's torch router"))
    sort_free_layout: bool = Field(True, description=(
        "triton, triton_fp8: build small steps' expert-sorted layout in one kernel launch instead of a torch "
        "sort and a dozen small ops"))
    masked_max_tokens: int = Field(64, ge=0, description=(
        "deep_gemm: steps with at most this many tokens use the masked layout, longer ones the contiguous one"))
    warmup_tokens: list[int] = Field([1, 16, 64, 256, 4096], description=(
        "deep_gemm: token counts the layer runs once at load, to JIT-compile DeepGEMM's kernels"))
