"""Triton kernels whose per-row result does not depend on the batch (``batch_invariant.py`` uses them).

Each kernel fixes its reduction order from the shapes of the row's own problem, never from the number
of rows (peers.md §5; reference/deepinfer.md §9):

- ``bi_matmul``: a GEMM with constant tiles (``GEMM_BLOCK_M × GEMM_BLOCK_N × GEMM_BLOCK_K``), no split-K,
  K walked in order. An output element is one ``tl.dot`` chain over ``K / GEMM_BLOCK_K`` steps, the same
  whatever the row's tile mates, so a row's bits depend on its own data and K only.
- ``chunked_gqa_attention`` / ``chunked_mla_attention``: the decode kernels (``triton_decode.py``,
  ``triton_mla.py``) with ``FIXED_CHUNK``, one program per (query token, KV head or head block, key
  chunk). Chunks are ``KEY_CHUNK`` keys at absolute positions, so how many there are depends
  on the token's own visible range alone; inside a chunk, ``KEY_TILE`` key tiles are walked in order
  starting at the aligned tile that holds the chunk's first visible key (no tile is wholly masked). The
  merge walks the token's chunks in order with an online log-sum-exp. Every query token, prefill or
  decode, takes this one path, so how a prompt was chunked cannot change its keys in later layers.

The kernels read only device tensors and every launch dimension comes from tensor shapes, so the
backends can be captured in CUDA graphs. Under ``TRITON_INTERPRET=1`` ``tl.dot`` operands are float32
(``split_kv.dot_dtype``: the interpreter's bf16 ``tl.dot`` is wrong), and the GEMM's tiles, whose rows
are unrelated tokens, multiply without ``tl.dot`` (``row_exact_dot``). The attention tiles' rows are the
query heads of one token, the same set in every batch, so they keep ``tl.dot`` everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.testing import triton_interpreting
from deepinfer_attention.split_kv import dot_dtype
from deepinfer_attention.triton_decode import launch_gqa_kernel
from deepinfer_attention.triton_mla import default_block_h, launch_mla_kernel

GEMM_BLOCK_M = 64
GEMM_BLOCK_N = 64
GEMM_BLOCK_K = 64
# Keys per chunk (one program each) and per tile inside a chunk; KEY_CHUNK is a multiple of KEY_TILE.
KEY_CHUNK = 256
KEY_TILE = 32
# Float32 bytes the attention partials of one launch may take; longer steps launch in token slices.
PARTIAL_BYTES = 256 << 20


def row_exact_dot() -> bool:
    """Whether GEMM tiles must avoid ``tl.dot``: under ``TRITON_INTERPRET=1`` it is numpy's BLAS call,
    whose result for one row of a tile changes with the tile's other rows (measured: a row alone and the
    same row among others differ in the last bits), which on the GPU's MMA units it does not. The CPU
    tests then check the kernels' tiling and order with a product whose rows are independent."""
    return triton_interpreting()


def _precision(dtype: torch.dtype) -> str | None:
    """Float32 operands multiply in IEEE float32 (not TF32) so fp32 runs stay close to the reference."""
    return "ieee" if dtype == torch.float32 else None


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, out_ptr, m, n, k,
                   stride_xb, stride_xm, stride_xk, stride_wb, stride_wn, stride_wk, stride_ob, stride_om, stride_on,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, ROW_EXACT: tl.constexpr):
    """One program: a ``BLOCK_M × BLOCK_N`` tile of ``out[b] = x[b] · w[b]ᵀ``, K in order. ``ROW_EXACT``
    (the interpreter) replaces ``tl.dot`` by a broadcast product summed over K (``row_exact_dot``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < m
    mask_n = offs_n < n
    x_rows = x_ptr + b * stride_xb + offs_m[:, None] * stride_xm
    w_cols = w_ptr + b * stride_wb + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < k
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None] * stride_wk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if ROW_EXACT:
            acc += tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=PRECISION)
    out = out_ptr + b * stride_ob + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def bi_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [B, M, K] · w[B, N, K]ᵀ`` → ``[B, M, N]`` in ``x.dtype`` (any strides), each output row's
    bits independent of M and of the row's index."""
    batch, rows, depth = x.shape
    cols = w.shape[1]
    out = x.new_empty(batch, rows, cols)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, GEMM_BLOCK_M), triton.cdiv(cols, GEMM_BLOCK_N), batch)
    _matmul_kernel[grid](
        x, w, out, rows, cols, depth, x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K, DOT_DTYPE=dot_dtype(x.dtype),
        PRECISION=_precision(x.dtype), ROW_EXACT=row_exact_dot(), num_warps=4, num_stages=3)
    return out


def visible_range(positions: torch.Tensor, token_req: torch.Tensor | None, window: int,
                  visibility_floor: torch.Tensor | None) -> torch.Tensor:
    """Per query token its first visible key position (``int64 [N]``): 0, or with a window
    ``max(0, p + 1 − window)`` raised to the request's visibility floor but never past ``p`` itself
    (``ForwardContext.visibility_floor``). Device ops only."""
    lo = torch.zeros_like(positions, dtype=torch.int64)
    if window > 0:
        lo = (positions.to(torch.int64) + 1 - window).clamp(min=0)
        if visibility_floor is not None:
            floor = visibility_floor if token_req is None else visibility_floor.index_select(0, token_req)
            lo = torch.maximum(lo, torch.minimum(floor.to(torch.int64), positions.to(torch.int64)))
    return lo


@triton.jit
def _merge_chunks_kernel(part_out_ptr, part_lse_ptr, positions_ptr, lo_ptr, out_ptr, head_dim, num_chunks,
                         stride_ot, stride_oh, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (token, head): the token's chunks merged in ascending order,
    ``out = Σ_c 2^(lse_c − m) · part_c / Σ_c 2^(lse_c − m)`` as a running (online) sum."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    end = tl.load(positions_ptr + t) + 1
    lo = tl.load(lo_ptr + t)
    base = (t * tl.num_programs(1) + h) * num_chunks
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    m = tl.full([BLOCK_D], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for c in range(lo // CHUNK, (end - 1) // CHUNK + 1):
        lse = tl.load(part_lse_ptr + base + c)
        part = tl.load(part_out_ptr + (base + c) * head_dim + offs_d, mask=mask_d, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(lse - m_new)
        acc = acc * alpha + part * beta
        denom = denom * alpha + beta
        m = m_new
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, (acc / denom).to(out_ptr.dtype.element_ty),
             mask=mask_d)


def _slice_tokens(tokens: int, heads: int, num_chunks: int, width: int) -> int:
    """Query tokens per launch so that its partials fit in ``PARTIAL_BYTES`` (a token's result does not
    depend on the slice it is launched in)."""
    per_token = heads * num_chunks * (width + 1) * 4
    return max(1, min(tokens, PARTIAL_BYTES // per_token))


def chunked_gqa_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          positions: torch.Tensor, token_req: torch.Tensor | None, *, scale: float, window: int = 0,
                          visibility_floor: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q [N, Hq, D]`` over the paged ``k_cache, v_cache [blocks, block_size, Hkv, D]``
    with the contract of ``triton_decode.paged_gqa_attention`` (token ``t`` of request ``token_req[t]``,
    ``None``: request ``t``, sees its keys at positions ``≤ positions[t]``, windowed and floored), each
    token's bits independent of the batch. Returns ``[N, Hq, D]`` in ``q.dtype``."""
    tokens, q_heads, head_dim = q.shape
    out = q.new_empty(tokens, q_heads, head_dim)
    lo = visible_range(positions, token_req, window, visibility_floor)
    num_chunks = triton.cdiv(block_tables.shape[1] * k_cache.shape[1], KEY_CHUNK)
    step = _slice_tokens(tokens, q_heads, num_chunks, head_dim)
    for s in range(0, tokens, step):
        e = min(tokens, s + step)
        pos_s, lo_s, o = positions[s:e], lo[s:e], out[s:e]
        if token_req is None:  # token t is request t: the slice's block-table and floor rows go with it
            req_s, tables = None, block_tables[s:e]
            floor_s = None if visibility_floor is None else visibility_floor[s:e]
        else:
            req_s, tables, floor_s = token_req[s:e], block_tables, visibility_floor
        part_out = torch.empty(e - s, q_heads, num_chunks, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(e - s, q_heads, num_chunks, dtype=torch.float32, device=q.device)
        launch_gqa_kernel(q[s:e], k_cache, v_cache, tables, pos_s, req_s, o, part_out, part_lse, scale=scale,
                          window=window, visibility_floor=floor_s, num_parts=num_chunks, block_n=KEY_TILE,
                          fixed_chunk=KEY_CHUNK, operand_dtype=k_cache.dtype)
        _merge_chunks_kernel[(e - s, q_heads)](part_out, part_lse, pos_s, lo_s, o, head_dim, num_chunks, o.stride(0),
                                               o.stride(1), CHUNK=KEY_CHUNK,
                                               BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    return out


def chunked_mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                          positions: torch.Tensor, token_req: torch.Tensor | None, *, scale: float) -> torch.Tensor:
    """Absorbed MLA with the contract of ``triton_mla.paged_mla_attention`` (``q_lat [N, H, C]``,
    ``q_pe [N, H, R]``, ``cache [blocks, block_size, C + R]``), each token's bits independent of the
    batch. Returns the latent output ``[N, H, C]`` in ``q_lat.dtype``."""
    tokens, num_heads, latent_dim = q_lat.shape
    out = q_lat.new_empty(tokens, num_heads, latent_dim)
    lo = torch.zeros_like(positions, dtype=torch.int64)
    num_chunks = triton.cdiv(block_tables.shape[1] * cache.shape[1], KEY_CHUNK)
    step = _slice_tokens(tokens, num_heads, num_chunks, latent_dim)
    for s in range(0, tokens, step):
        e = min(tokens, s + step)
        pos_s, lo_s, o = positions[s:e], lo[s:e], out[s:e]
        req_s, tables = (None, block_tables[s:e]) if token_req is None else (token_req[s:e], block_tables)
        part_out = torch.empty(e - s, num_heads, num_chunks, latent_dim, dtype=torch.float32, device=q_lat.device)
        part_lse = torch.empty(e - s, num_heads, num_chunks, dtype=torch.float32, device=q_lat.device)
        launch_mla_kernel(q_lat[s:e], q_pe[s:e], cache, tables, pos_s, req_s, o, part_out, part_lse, scale=scale,
                          num_parts=num_chunks, block_h=default_block_h(num_heads), block_n=KEY_TILE,
                          fixed_chunk=KEY_CHUNK, operand_dtype=cache.dtype)
        _merge_chunks_kernel[(e - s, num_heads)](part_out, part_lse, pos_s, lo_s, o, latent_dim, num_chunks,
                                                 o.stride(0), o.stride(1), CHUNK=KEY_CHUNK,
                                                 BLOCK_D=max(16, triton.next_power_of_2(latent_dim)))
    return out
