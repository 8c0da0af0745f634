"""The plugin's face: its config model and hookimpls."""

from __future__ import annotations

from typing import Any

from deepinfer import hookimpl
from deepinfer_cpu.config import CPUConfig
from deepinfer_cpu.onednn import OneDNNGemmBackend
from deepinfer_cpu.paged_attention import CPUPagedAttentionBackend


class Plugin:
    """Offers the ``onednn`` GEMM backend and the ``cpu_paged`` attention backend (README.md)."""

    config_model = CPUConfig

    def __init__(self, config: CPUConfig) -> None:
        self.config = config

    @hookimpl
    def deepinfer_gemm_backends(self) -> list[Any]:
        return [OneDNNGemmBackend(min_rows=self.config.min_rows, pack_rows=self.config.pack_rows)]

    @hookimpl
    def deepinfer_attention_backends(self) -> list[Any]:
        return [CPUPagedAttentionBackend()]
