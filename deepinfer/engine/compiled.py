"""``kernels.compile: inductor``: regional ``torch.compile`` of the decoder layers (the fused decode step).

Each layer of ``model.layers`` is compiled in place (``nn.Module.compile``), with a dynamic token
dimension, so one compiled graph serves every layer of a class and every CUDA graph bucket (Dynamo
guards on the layer's type and lifts its parameters to inputs; a one-token step gets its own
specialization). Inductor fuses what lies between two backend calls — RMSNorm with the residual add,
rope over q and k, the SwiGLU product, MoE router math, hyper-connection mixing — into a few Triton
kernels on CUDA (C++ on CPU); GEMMs stay extern calls to cuBLAS (or the CPU BLAS).

Backend ops are not traced: every op of a backend that does not declare ``traceable = True`` (attention,
MoE experts, any plugin GEMM) is wrapped in ``torch.compiler.disable``, a graph break around that one
call, so plugin kernels run exactly as without compilation. The torch GEMM backend is traceable (it is
``F.linear``). The first step of each shape compiles (the CUDA-graph warm-up does it for every bucket
before capture, so replays never compile); Inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``) makes a
second start cheaper. Steps a model plans request by request on host lists (DeepSeek-V4's prefill chunks)
run the plain layers (``deepseek_v4/rows.layer_stance``). ``compile_layers`` raises Dynamo's process-wide
recompile limit to ``RECOMPILE_LIMIT``. The plain-torch layers stay the reference: ``kernels.compile: off``
(the default).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from typing import Any

import torch

from deepinfer.errors import ConfigError
from deepinfer.plugins import UnfitBackend

RECOMPILE_LIMIT = 64  # compiled entries per layer function (``compile_layers``)


class OpaqueBackend:
    """A backend whose op methods Dynamo does not trace (each call is a graph break); every other
    attribute (name, capabilities, ``prepare_weight`` …) is the wrapped backend's."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        for op in backend.ops:
            method = getattr(backend, op, None)
            if callable(method):
                setattr(self, op, torch.compiler.disable(method, recursive=True))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def check_compile_support(device: torch.device, batch_invariant: bool) -> None:
    """Refuse ``kernels.compile=inductor`` where it cannot run, naming what is missing."""
    if batch_invariant:
        raise ConfigError("kernels.compile=inductor cannot be combined with kernels.batch_invariant: Inductor "
                          "chooses reduction tilings per shape, so a row's result would depend on the batch")
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ConfigError("kernels.compile=inductor on CUDA needs the triton package (not installed); "
                              "set kernels.compile=off") from None
    elif device.type == "cpu":
        if shutil.which("g++") is None and shutil.which("c++") is None and shutil.which("clang++") is None:
            raise ConfigError("kernels.compile=inductor on CPU needs a C++ compiler (g++, c++ or clang++ on "
                              "PATH); set kernels.compile=off")
    else:
        raise ConfigError(f"kernels.compile=inductor supports cuda and cpu devices, not {device.type!r}")


def compile_layers(model: torch.nn.Module, backends: Mapping[str, Any]) -> dict[str, Any]:
    """Compile every layer of ``model.layers`` in place; returns the backends to run it with (the
    non-traceable ones wrapped in ``OpaqueBackend``, one wrapper per backend object)."""
    wrapped: dict[int, Any] = {}
    out: dict[str, Any] = {}
    for op, backend in backends.items():
        if isinstance(backend, UnfitBackend) or getattr(backend, "traceable", False):
            out[op] = backend
            continue
        if id(backend) not in wrapped:
            wrapped[id(backend)] = OpaqueBackend(backend)
        out[op] = wrapped[id(backend)]
    # One compiled entry per layer kind × (one token, many tokens) × step kind: DeepSeek-V4 has 3 attention
    # kinds, hash and routed MoE layers, and speculative verification steps, past Dynamo's default of 8
    # entries per function, after which further variants would silently run eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for layer in model.layers:
        layer.compile(dynamic=True)
    return out
