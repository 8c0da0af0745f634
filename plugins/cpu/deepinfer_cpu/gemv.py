"""Decode and verification steps' projections: a few input rows times a row-major float32 or bfloat16 weight
(``csrc/gemv.c``).

torch's matrix-vector product streams SmolLM2's weights at 11–25 GB/s on the 2-core VM (the row-major layout
at ~14, the column-major one the ``onednn`` backend used to keep at 15–25); the kernel, one weight stream per
thread read from memory once for up to 4 input rows (then from L1 for the next 4), reads a whole one-row
step's projections at 33–60 GB/s as the VM's memory allows (``csrc/gemv.c``, ``docs/benchmarks.md``). Each
row's sums run in one order whatever the number of rows, so a row's result is bitwise the same alone or beside
others. ``OneDNNGemmBackend`` sends its float32 and bfloat16 calls of fewer than ``min_rows`` rows here.
On a CPU with AMX-BF16 a bfloat16 weight whose sides are multiples of 32 goes through the tile unit, one pass
over the weight for up to 32 rows: a verification step's rows then cost little more than one decode row
(``bf16_kernel`` says which kernel serves a shape).
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
    for name in ("gemv_f32", "gemv_bf16"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.gemv_bf16_kernel.restype = ctypes.c_int
    lib.gemv_bf16_kernel.argtypes = [ctypes.c_int64] * 2
    return lib


BF16_KERNELS = ("widen", "avx512_bf16", "amx")  # indexed by gemv_bf16_kernel's answer


def bf16_kernel(n: int, k: int) -> str:
    """Which kernel a bfloat16 call against an ``[n, k]`` weight runs on this machine: ``amx`` (AMX-BF16 tiles,
    when ``n`` and ``k`` are multiples of 32), ``avx512_bf16`` (``vdpbf16ps``) or ``widen`` (each weight widened
    to float32)."""
    return BF16_KERNELS[load_kernel().gemv_bf16_kernel(n, k)]


@functools.cache
def amx_available() -> bool:
    """Whether bfloat16 weights whose sides are multiples of 32 run on AMX tiles on this machine (``bf16_kernel``)."""
    return _buildable() and bf16_kernel(32, 32) == "amx"


@functools.cache
def _buildable() -> bool:
    return compiler() is not None


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` serves ``x @ weightᵀ``: rows against a contiguous weight of the same dtype, float32 or
    bfloat16, on a machine that can build the kernel."""
    return (x.dtype == weight.dtype and x.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and weight.is_contiguous() and x.shape[-1] == weight.shape[1] and _buildable())


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` times ``weight [N, K]``ᵀ (+ ``bias [N]``) → ``[..., N]`` (``fits`` holds).

    A decode step makes ~120 of these calls, so the wrapper does the least it can (issue 36): rows that are
    already contiguous are passed as they are, and the output is allocated in its final shape. A bfloat16 call
    sums in float32 and rounds the result to bfloat16 once, as oneDNN's bf16 GEMM does: on a CPU with
    AVX512-BF16 its rows are taken as bfloat16 (they are, in a bf16 model) and each pair of products is summed by
    ``vdpbf16ps``; elsewhere its rows stay float32 and each weight is widened where it is loaded
    (``csrc/gemv.c``)."""
    n, k = weight.shape
    bf16 = weight.dtype == torch.bfloat16
    if bf16:
        x = x.float().contiguous()
    elif not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    bias_arg = None
    if bias is not None:
        bias = bias.contiguous().float()
        bias_arg = bias.data_ptr()
    kernel = _kernels()[bf16]
    kernel(x.data_ptr(), weight.data_ptr(), bias_arg, out.data_ptr(), x.numel() // k if k else 0, n, k,
           torch.get_num_threads())
    return out.bfloat16() if bf16 else out


@functools.cache
def _kernels() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    """The float32 and the bfloat16 kernel (indexed by ``bf16``)."""
    lib = load_kernel()
    return lib.gemv_f32, lib.gemv_bf16
