"""The grouped GEMM of the ``triton_bi`` MoE backend (``batch_invariant.py``), in Triton.

``grouped_matmul`` multiplies the rows of an expert-sorted ``BlockLayout`` (``layout.py``) by their
block's expert weight with constant tiles (``BLOCK_M × BLOCK_N × BLOCK_K``), no split-K and K walked in
order: a pair's output row is one ``tl.dot`` chain over K whatever other pairs share its block and
wherever it sits in it, so the row's bits depend on its own data and K only (the GPU's MMA units compute
each output element from its own row and column).

Under ``TRITON_INTERPRET=1`` (the CPU tests) ``tl.dot`` is numpy's BLAS call, whose result for one row of
a tile changes with the tile's other rows; there the tiles multiply as a broadcast product summed over
K instead (``ROW_EXACT``), so the tests check the tiling, the layout and the order, not numpy's BLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.testing import triton_interpreting
from deepinfer_moe.layout import BlockLayout

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _grouped_matmul_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, pairs_per_row, n, k,
                           stride_xm, stride_we, stride_wn, stride_om,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ROW_EXACT: tl.constexpr):
    """One program: ``BLOCK_M`` pairs of one expert × ``BLOCK_N`` output columns; pair ``p`` reads row
    ``p // pairs_per_row`` of ``x`` and writes row ``p`` of ``out``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a block past the last expert's rows
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    src = tl.where(row_ok, pair // pairs_per_row, 0).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_ok = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + src[:, None] * stride_xm
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k
        a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if ROW_EXACT:
            acc += tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=PRECISION)
    out = out_ptr + tl.where(row_ok, pair, 0).to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, layout: BlockLayout, pairs_per_row: int) -> torch.Tensor:
    """``out[p] = x[p // pairs_per_row] · w[expert(p)]ᵀ`` for every pair ``p`` of ``layout`` (built with
    ``BLOCK_M`` rows per block): ``x [rows, K]``, ``w [E, N, K]`` (both contiguous along K) →
    ``[num_pairs, N]`` in ``x.dtype``."""
    if layout.block_m != BLOCK_M:
        raise ValueError(f"grouped_matmul needs a layout of {BLOCK_M}-row blocks, got {layout.block_m}")
    if x.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("grouped_matmul needs x and w contiguous along K")
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(layout.num_pairs, n, dtype=x.dtype, device=x.device)
    interpret = triton_interpreting()
    _grouped_matmul_kernel[(layout.num_blocks, triton.cdiv(n, BLOCK_N))](
        x, w, out, layout.pairs, layout.block_expert, layout.num_pairs, pairs_per_row, n, k,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        DOT_DTYPE=tl.float32 if interpret else _TL_DTYPES[x.dtype],
        PRECISION="ieee" if x.dtype == torch.float32 else None, ROW_EXACT=interpret, num_warps=4, num_stages=3)
    return out
