"""The plugin's face: its config model and hookimpls."""

from __future__ import annotations

from typing import Any

from deepinfer import hookimpl
from deepinfer_moe.batch_invariant import TritonBIMoEBackend
from deepinfer_moe.config import MoEConfig
from deepinfer_moe.deepgemm_backend import DeepGemmMoEBackend
from deepinfer_moe.grouped import GroupedMoEBackend
from deepinfer_moe.triton_backend import TritonMoEBackend

# kernels.moe: auto takes the highest priority that fits. Priorities: the core's torch 0, deep_gemm 4,
# triton_fp8 5, grouped 10, triton 20; with auto_fp8 the FP8 backends move above bf16 triton. triton_bi (-5)
# declares batch_invariant and serves only that mode.
_FP8_AUTO_PRIORITY = {"deep_gemm": 30, "triton_fp8": 25}


class Plugin:
    """Offers the MoE backends of this package (README.md)."""

    config_model = MoEConfig

    def __init__(self, config: MoEConfig) -> None:
        self.config = config

    @hookimpl
    def deepinfer_moe_backends(self) -> list[Any]:
        cfg = self.config
        triton = {"decode_max_tokens": cfg.decode_max_tokens, "fused_router": cfg.fused_router,
                  "sort_free_layout": cfg.sort_free_layout}
        triton_fp8 = TritonMoEBackend(fp8=True, **triton)
        deep_gemm = DeepGemmMoEBackend(masked_max_tokens=cfg.masked_max_tokens,
                                       warmup_tokens=tuple(cfg.warmup_tokens))
        if cfg.auto_fp8 and not triton_fp8.interpret:
            triton_fp8.priority = _FP8_AUTO_PRIORITY["triton_fp8"]
            deep_gemm.priority = _FP8_AUTO_PRIORITY["deep_gemm"]
        return [GroupedMoEBackend(), TritonMoEBackend(**triton), triton_fp8,
                deep_gemm, TritonBIMoEBackend()]
