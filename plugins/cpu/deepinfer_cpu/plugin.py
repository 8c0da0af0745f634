"""The plugin's face: its config model and hookimpls."""

from __future__ import annotations

from typing import Any

from deepinfer import hookimpl
from deepinfer.config import EngineConfig
from deepinfer.errors import ConfigError
from deepinfer.interfaces import EngineInfo
from deepinfer_cpu.cbuild import compiler
from deepinfer_cpu.config import CPUConfig
from deepinfer_cpu.onednn import OneDNNGemmBackend
from deepinfer_cpu.paged_attention import CPUPagedAttentionBackend
from deepinfer_cpu.quant_linear import FORMATS, QuantizedGemmBackend


class Plugin:
    """Offers the ``onednn`` GEMM backend, the ``cpu_paged`` attention backend and, for a run with
    ``model.quantization`` ``int8`` or ``q4_1``, the ``cpu_int8`` / ``cpu_q4_1`` GEMM backend (README.md)."""

    config_model = CPUConfig

    def __init__(self, config: CPUConfig) -> None:
        self.config = config
        self.quantization: str | None = None  # this run's model.quantization, once validated
        self.vocab_size: int | None = None

    @hookimpl
    def deepinfer_weight_quantizations(self) -> list[str]:
        return list(FORMATS) if compiler() is not None else []

    @hookimpl
    def deepinfer_validate_config(self, config: EngineConfig, info: EngineInfo) -> None:
        """Remember a quantized run's format (its GEMM backend is offered to it) and refuse what the
        kernels cannot serve."""
        fmt = config.model.quantization
        if fmt not in FORMATS:
            self.quantization = None
            return
        gaps = []
        if info.device != "cpu":
            gaps.append(f"runs on the CPU only (this run: {info.device})")
        if info.dtype != "float32":
            gaps.append(f"computes in float32 only (model.dtype resolves to {info.dtype}; set model.dtype=float32)")
        if config.kernels.gemm not in ("auto", f"cpu_{fmt}"):
            gaps.append(f"needs kernels.gemm auto or cpu_{fmt} (got {config.kernels.gemm!r})")
        if config.kernels.batch_invariant:
            gaps.append("is not batch-invariant (kernels.batch_invariant is on)")
        if gaps:
            raise ConfigError(f"plugins.cpu: model.quantization={fmt!r} " + "; ".join(gaps))
        self.quantization, self.vocab_size = fmt, info.vocab_size

    @hookimpl
    def deepinfer_gemm_backends(self) -> list[Any]:
        backends: list[Any] = [OneDNNGemmBackend(min_rows=self.config.min_rows, pack_rows=self.config.pack_rows,
                                                     fused_decode=self.config.fused_decode,
                                                     fused_draft=self.config.fused_draft,
                                                     huge_pages=self.config.huge_pages)]
        if self.quantization is not None:
            backends.append(QuantizedGemmBackend(self.quantization, head_rows=self.vocab_size,
                                                 dense_rows=self.config.quant_dense_rows,
                                                 inputs=self.config.quant_inputs,
                                                 fused_decode=self.config.fused_decode,
                                                 huge_pages=self.config.huge_pages))
        return backends

    @hookimpl
    def deepinfer_attention_backends(self) -> list[Any]:
        return [CPUPagedAttentionBackend()]
