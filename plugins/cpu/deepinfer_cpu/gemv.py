"""A batch-1 decode step's projections: one input row times a row-major float32 weight (``csrc/gemv.c``).

torch's matrix-vector product streams SmolLM2's weights at 11–25 GB/s on the 2-core VM (the row-major
layout at ~14, the column-major one the ``onednn`` backend used to keep at 15–25); the kernel's eight
weight streams with 32-lane sums reach 31–39 GB/s on every projection shape of that model
(``docs/benchmarks.md``). ``OneDNNGemmBackend`` sends its one-row float32 calls here.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from deepinfer_cpu.cbuild import CSRC, build_library, compiler

SOURCE = CSRC / "gemv.c"


@functools.cache
def load_kernel() -> ctypes.CDLL:
    """The compiled kernel library, built into the cache on first use."""
    lib = build_library(SOURCE)
    lib.gemv_f32.restype = None
    lib.gemv_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    return lib


@functools.cache
def _buildable() -> bool:
    return compiler() is not None


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` serves ``x @ weightᵀ``: one float32 row against a contiguous float32 weight, on a
    machine that can build the kernel."""
    return (x.dtype == weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
            and x.numel() == x.shape[-1] == weight.shape[1] and _buildable())


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` (one row) times ``weight [N, K]``ᵀ (+ ``bias [N]``) → ``[..., N]`` (``fits`` holds)."""
    n = weight.shape[0]
    row = x.reshape(-1).contiguous()
    out = torch.empty(n, dtype=torch.float32)
    bias_arg = None
    if bias is not None:
        bias = bias.contiguous().float()
        bias_arg = bias.data_ptr()
    load_kernel().gemv_f32(row.data_ptr(), weight.data_ptr(), bias_arg, out.data_ptr(), n, weight.shape[1],
                           torch.get_num_threads())
    return out.reshape(*x.shape[:-1], n)
