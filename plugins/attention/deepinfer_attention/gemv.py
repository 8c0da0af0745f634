"""``triton_gemv`` (op ``linear``): a split-K Triton GEMV for decode-sized inputs, cuBLAS above.

At batch 1–16 a decode step's linears are memory-bound: all that matters is reading the ``[out, in]``
weight once at the copy bandwidth. cuBLAS picks skinny-M kernels that read the narrow projections
(Llama's qkv and o, 4096 wide) at 3.1 TB/s where the wide ones reach 4.2 (docs/benchmarks.md, issue 29).
This kernel streams the weight in ``BLOCK_N × BLOCK_K`` tiles against the whole input (M ≤ 16 rows,
padded to 16 for ``tl.dot``), and splits K over several programs when the output alone gives too few
tiles to fill the GPU; the partial sums (fp32) are added in a fixed order by one ``sum`` afterwards,
so a row's result does not depend on scheduling (it still depends on M's split choice: this backend
does not declare ``batch_invariant``).

Inputs with more than ``MAX_ROWS`` rows go to ``F.linear`` (cuBLAS). ``available()`` needs ``import
triton`` and CUDA, or ``TRITON_INTERPRET=1`` (the CPU tests; then it also declares the CPU device).
Its priority is below the core's torch backend: ``kernels.gemm: triton_gemv`` names it. Measured on the
H200 it is 0.80–0.96× cuBLAS on a Llama layer's projections and 1.01–1.04× on the LM head
(docs/benchmarks.md), so it is not a default.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deepinfer.interfaces import BackendCapabilities
from deepinfer.testing import triton_interpreting
from deepinfer_attention.triton_backends import triton_usable

MAX_ROWS = 16
BLOCK_N = 64
BLOCK_K = 128
# Aim for this many programs (the H200 has 132 SMs) before splitting K further.
TARGET_PROGRAMS = 264
_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


def split_count(n: int, k: int, *, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                target: int = TARGET_PROGRAMS) -> int:
    """How many K slices a ``[≤16, k] · [n, k]ᵀ`` product is cut into: enough for ``target`` programs
    over the ``ceil(n / block_n)`` output tiles, never a slice shorter than 4 ``block_k`` steps."""
    tiles = -(-n // block_n)
    most = max(1, k // (4 * block_k))
    return max(1, min(most, -(-target // tiles)))


@functools.cache
def _kernel():  # imports triton: only when a GEMV first runs
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_splitk(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, k_per_split,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
        """``out[split, m, n] = Σ_{k in split} x[m, k] · w[n, k]`` in fp32."""
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_begin = split * k_per_split
        for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                        mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                        mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32, input_precision=PRECISION)
        offsets = split * M * N + rows[:, None] * N + cols[None, :]
        tl.store(out_ptr + offsets, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))

    return gemv_splitk


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision``: float32 operands multiply in IEEE float32, not TF32 (``tl.dot``'s
    default, which rounds them to 10 mantissa bits: an fp32 model would then decode other tokens than with
    cuBLAS, whose float32 GEMMs are IEEE unless torch allows TF32); other dtypes are not affected by it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def gemv(x: torch.Tensor, weight: torch.Tensor, *, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
         target: int = TARGET_PROGRAMS) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]ᵀ`` for ``M ≤ MAX_ROWS``, in ``x``'s dtype (fp32 accumulation). The tile
    sizes and the program target are the defaults above; ``scripts/bench_gemv.py`` sweeps them."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1
    x = x.contiguous()
    splits = split_count(n, k, block_n=block_n, block_k=block_k, target=target)
    per_split = -(-k // (splits * block_k)) * block_k
    splits = -(-k // per_split)
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _kernel()[(-(-n // block_n), splits)](x, weight, partial, m, n, k, x.stride(0), weight.stride(0), per_split,
                                          BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
                                          PRECISION=_precision(x.dtype))
    out = partial[0] if splits == 1 else partial.sum(dim=0)
    return out.to(x.dtype)


class TritonGemvBackend:
    """Op ``linear``: ``gemv`` for inputs of at most ``MAX_ROWS`` rows, ``F.linear`` above."""

    name = "triton_gemv"
    ops = frozenset({"linear"})

    def __init__(self) -> None:
        interpreting = triton_interpreting()
        self.priority = -20 if interpreting else -1
        devices = frozenset({"cuda", "cpu"}) if interpreting else frozenset({"cuda"})
        self.capabilities = BackendCapabilities(devices=devices, dtypes=_DTYPES, graph_safe=True)

    def available(self) -> bool:
        return triton_usable()

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.contiguous()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ weight[out, in]ᵀ (+ bias)``."""
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > MAX_ROWS or flat.shape[0] == 0:
            return F.linear(x, weight, bias)
        out = gemv(flat, weight)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])
