"""Paged GQA attention for prefill chunks (requests with many query tokens), in Triton.

Flash-attention style: one program answers one tile of consecutive query tokens of one request for all
query heads of one KV head (the GQA group is folded into the tile's rows, row ``r`` being token
``r // GROUP`` and head ``r % GROUP`` of the group, so each K/V tile is loaded once per group) and walks
the request's paged cache in tiles of ``BLOCK_N`` keys with an online softmax (float32 scores, ``exp2``).
The chunk's own K/V must already be in the cache, so a chunk after a cached prefix sees the prefix.

A query at position ``p`` sees keys ``[0, p]``, or with ``window > 0`` keys ``[p + 1 − window, p]`` and
none below its request's ``visibility_floor`` but its own. A tile visits only the key range its rows can
see: ``[first − window + 1, last]`` for query positions ``[first, last]``, so a sliding-window prompt of
``L`` tokens costs ``O(L · (tile + window))``, not ``O(L²)``. Key tiles that every row sees whole (at or
before the first query, inside the last query's window) skip the masks; only the band's edges are masked.

With an FP8 cache (``deepinfer/kv/fp8.py``) each K/V tile is read as e4m3 bytes and UE8M0 scale bytes and
dequantized exactly in registers to the ``tl.dot`` dtype (``kernel_steps.load_fp8_tile``, as the decode kernel).

The tiles are listed on the host from the step's host lists (``query_start_loc_host``): prefill steps are
never captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from deepinfer.ops import to_device
from deepinfer_attention import kernel_steps
from deepinfer_attention.split_kv import LOG2E, dot_dtype, tile_width


@triton.jit
def _attend(q, m, denom, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, req, kv_head,
            pos, floor, window, key_lo, key_hi, end, qk_scale, offs_d, mask_d, head_dim, stride_kb, stride_ks,
            stride_kh, stride_vb, stride_vs, stride_vh, stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss,
            stride_vsh, stride_bt, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            MASKED: tl.constexpr, HAS_FLOOR: tl.constexpr, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The online softmax over key tiles ``[key_lo, key_hi)``; ``MASKED`` False: every key is visible to
    every row (no causal, window or floor test, no bound on ``end``). ``FP8``: the cache is e4m3 with
    UE8M0 scale bytes, read through ``kernel_steps.load_fp8_tile``."""
    for start in range(key_lo, key_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if MASKED:
            block = tl.load(block_tables_ptr + req * stride_bt + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
            rows = mask_n
        else:
            block = tl.load(block_tables_ptr + req * stride_bt + offs_n // BLOCK_SIZE)
            rows = tl.full([BLOCK_N], True, tl.int1)
        k, v = kernel_steps.load_kv_tiles(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block.to(tl.int64), offs_n % BLOCK_SIZE, kv_head, rows,
            offs_d, mask_d, head_dim, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ksb,
            stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh, BLOCK_N, BLOCK_D, FP8, DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        if MASKED:
            visible = (offs_n[None, :] <= pos[:, None]) & mask_n[None, :]
            visible &= (window <= 0) | (offs_n[None, :] > pos[:, None] - window)
            if HAS_FLOOR:
                visible &= (window <= 0) | (offs_n[None, :] >= floor) | (offs_n[None, :] == pos[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m - shift)
        p = tl.exp2(s - shift[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        m = m_new
    return m, denom, acc


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, positions_ptr,
                    floor_ptr, tiles_ptr, out_ptr, qk_scale, window, head_dim,
                    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
                    stride_bt, stride_ot, stride_oh,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HAS_FLOOR: tl.constexpr, FP8: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    req = tl.load(tiles_ptr + tile * 3).to(tl.int64)
    tok_lo = tl.load(tiles_ptr + tile * 3 + 1).to(tl.int64)
    tok_hi = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tok_lo + offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    mask_r = (offs_r < (BLOCK_M // GROUP) * GROUP) & (tok < tok_hi)
    mask_d = offs_d < head_dim
    pos = tl.load(positions_ptr + tok, mask=mask_r, other=-1)
    first = tl.load(positions_ptr + tok_lo)
    last = tl.load(positions_ptr + tok_hi - 1)
    end = last + 1  # keys [lo, end) cover every row of the tile
    lo = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)
    # Keys [full_lo, first] are visible to every row: at or before the first query, inside the last one's window.
    full_lo = tl.where(window > 0, tl.maximum(last - window + 1, 0), 0)
    floor = first  # unused without floors
    if HAS_FLOOR:  # bounded replay: with a window, keys below the floor are gone, except a query's own
        floor = tl.load(floor_ptr + req)
        lo = tl.where(window > 0, tl.maximum(lo, tl.minimum(floor, first)), lo)
        full_lo = tl.where(window > 0, end, full_lo)  # rows below the floor see only themselves: mask every tile
    lo = lo // BLOCK_N * BLOCK_N  # whole key tiles; the masks drop the keys before the band
    # Key tiles [lo, mid_lo) and [mid_hi, end) are masked, [mid_lo, mid_hi) lie wholly in [full_lo, first].
    mid_lo = lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N
    mid_hi = mid_lo + tl.maximum(first + 1 - mid_lo, 0) // BLOCK_N * BLOCK_N

    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m, denom, acc = _attend(q, m, denom, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                            req, kv_head, pos, floor, window, lo, mid_lo, end, qk_scale, offs_d, mask_d, head_dim,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ksb, stride_kss,
                            stride_ksh, stride_vsb, stride_vss, stride_vsh, stride_bt, BLOCK_SIZE, BLOCK_N, BLOCK_D,
                            True, HAS_FLOOR, FP8, DOT_DTYPE)
    m, denom, acc = _attend(q, m, denom, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                            req, kv_head, pos, floor, window, mid_lo, mid_hi, end, qk_scale, offs_d, mask_d, head_dim,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ksb, stride_kss,
                            stride_ksh, stride_vsb, stride_vss, stride_vsh, stride_bt, BLOCK_SIZE, BLOCK_N, BLOCK_D,
                            False, HAS_FLOOR, FP8, DOT_DTYPE)
    m, denom, acc = _attend(q, m, denom, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                            req, kv_head, pos, floor, window, mid_hi, end, end, qk_scale, offs_d, mask_d, head_dim,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ksb, stride_kss,
                            stride_ksh, stride_vsb, stride_vss, stride_vsh, stride_bt, BLOCK_SIZE, BLOCK_N, BLOCK_D,
                            True, HAS_FLOOR, FP8, DOT_DTYPE)

    o = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])


def default_tile(head_dim: int, group: int, element_size: int) -> tuple[int, int]:
    """``(block_m, block_n)``: query rows (tokens × group heads) and keys per tile. 128 × 64 at head dims up
    to 128 in 16-bit, else 64 rows and ``block_n`` from a 16 KiB K tile (Q, K and V tiles of two pipeline
    stages stay within an H200's shared memory up to ``D = 256``); always room for one token's group."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = 128 if block_d <= 128 and element_size <= 2 else 64
    block_n = max(16, min(64, 16384 // (block_d * element_size)))
    return max(block_m, triton.next_power_of_2(group)), block_n


def prefill_tiles(query_starts: Sequence[int], requests: Sequence[int], tokens_per_tile: int,
                  device: torch.device) -> torch.Tensor:
    """``[tiles, 3]`` int32 rows ``(request, first token, end token)`` cutting each of ``requests``'
    query tokens ``[query_starts[i], query_starts[i + 1])`` into tiles of ``tokens_per_tile``; the last
    tiles of each request (the most keys under causality) come first, so the longest programs start early.
    Cached by its arguments: every layer of a step asks for the same tiles, and they are never written."""
    return _prefill_tiles(tuple(query_starts), tuple(requests), tokens_per_tile, device)


@functools.lru_cache(maxsize=64)
def _prefill_tiles(query_starts: tuple[int, ...], requests: tuple[int, ...], tokens_per_tile: int,
                   device: torch.device) -> torch.Tensor:
    tiles = []
    for i in requests:
        lo, hi = query_starts[i], query_starts[i + 1]
        tiles.extend((i, t, min(t + tokens_per_tile, hi)) for t in range(lo, hi, tokens_per_tile))
    tiles.sort(key=lambda row: row[2] - query_starts[row[0]], reverse=True)
    return to_device(tiles, torch.int32, device).view(-1, 3)  # never waits for the device (the launch path)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, positions: torch.Tensor, query_starts: Sequence[int],
                            requests: Sequence[int], *, scale: float, window: int = 0,
                            visibility_floor: torch.Tensor | None = None, out: torch.Tensor | None = None,
                            block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int = 2, k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the query tokens of ``requests`` (``q [T, Hq, D]``, request ``i``'s tokens
    ``[query_starts[i], query_starts[i + 1])`` at consecutive ``positions``) over the paged cache
    ``k_cache, v_cache [blocks, block_size, Hkv, D]`` (float8_e4m3fn with ``k_scales, v_scales [blocks,
    block_size, Hkv, ceil(D / 32)]``, UE8M0 bytes, for an FP8 cache) through ``block_tables[i]``, which
    must already hold their keys. Visibility as in the module docstring (``visibility_floor [B]``:
    ``ForwardContext``).

    Writes those tokens' rows of ``out [T, Hq, D]`` (``None``: a new tensor, other rows uninitialised)
    and returns it. ``block_m`` (query rows = tokens × group heads, a power of two), ``block_n``,
    ``num_warps``: ``None`` picks ``default_tile`` and 8 warps for 128 rows, else 4."""
    tokens, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = q_heads // kv_heads
    out = q.new_empty(tokens, q_heads, head_dim) if out is None else out
    fp8 = k_scales is not None and v_scales is not None
    # An FP8 tile is widened to the query's dtype in registers before its dot products: it takes that dtype's tiles.
    default_m, default_n = default_tile(head_dim, group, q.element_size() if fp8 else k_cache.element_size())
    block_m, block_n = block_m or default_m, block_n or default_n
    if block_m < group:
        raise ValueError(f"block_m={block_m} must hold one token's {group} query heads (the GQA group)")
    tiles = prefill_tiles(query_starts, requests, block_m // group, q.device)
    if tiles.shape[0] == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    ks, vs = (k_scales, v_scales) if fp8 else (k_cache, v_cache)  # unused by the kernel without FP8
    _prefill_kernel[(tiles.shape[0], kv_heads)](
        q, k_cache, v_cache, ks, vs, block_tables, positions,
        visibility_floor if visibility_floor is not None else positions, tiles, out, scale * LOG2E, window, head_dim,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, HAS_FLOOR=visibility_floor is not None, FP8=fp8, BLOCK_M=block_m,
        BLOCK_D=tile_width(head_dim, fp8), BLOCK_N=block_n, DOT_DTYPE=dot_dtype(q.dtype if fp8 else k_cache.dtype),
        num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=num_stages)
    return out
