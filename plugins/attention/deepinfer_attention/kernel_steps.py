"""Triton device functions the paged decode kernels (``triton_decode.py``, ``triton_mla.py``) share: a
program's query rows (``load_query``), which keys it answers (``part_range``) and where a tile of them
sits (``key_tile``), the read of an FP8 cache tile (``load_fp8_tile``), the online softmax
(``softmax_init``, ``softmax_step``) and the write of the program's result (``store_part``). Triton
inlines them into each kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_fp8_tile(data_ptrs, scale_ptrs, mask):
    """A tile of an FP8 cache (``deepinfer/kv/fp8.py``) as float32: e4m3 ``data_ptrs`` times the power of
    two of each element's UE8M0 scale byte at ``scale_ptrs`` (the caller points every element at its
    group's byte), rebuilt exactly as ``byte << 23`` read as a float32. Masked elements are 0."""
    data = tl.load(data_ptrs, mask=mask, other=0.0).to(tl.float32)
    scale = (tl.load(scale_ptrs, mask=mask, other=0).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return data * scale


@triton.jit
def load_query(ptr, t, stride_t, heads, stride_h, offs, mask_heads, mask_cols, DOT_DTYPE: tl.constexpr):
    """Token ``t``'s query rows ``heads`` at columns ``offs`` as ``[heads, columns]`` in the ``tl.dot``
    dtype (masked entries 0)."""
    return tl.load(ptr + t * stride_t + heads[:, None] * stride_h + offs[None, :],
                   mask=mask_heads[:, None] & mask_cols[None, :], other=0.0).to(DOT_DTYPE)


@triton.jit
def part_range(lo, end, part, NUM_SPLITS: tl.constexpr, FIXED_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys ``[part_lo, part_hi)`` of part ``part`` of a token's visible keys ``[lo, end)`` and ``first``,
    where its walk of ``BLOCK_N``-key tiles starts. ``FIXED_CHUNK == 0``: ``NUM_SPLITS`` chunks of equal
    width (a multiple of ``BLOCK_N``) from ``lo``, chosen from the shapes, the first tile at ``part_lo``.
    ``FIXED_CHUNK > 0``: the keys at absolute positions ``[part · FIXED_CHUNK, (part + 1) · FIXED_CHUNK)``,
    the first tile aligned to ``BLOCK_N`` (so how a token's keys are cut never depends on the batch)."""
    if FIXED_CHUNK > 0:
        part_lo = tl.maximum(lo, part * FIXED_CHUNK)
        part_hi = tl.minimum(end, (part + 1) * FIXED_CHUNK)
        first = part_lo // BLOCK_N * BLOCK_N
    else:
        chunk = tl.cdiv(tl.cdiv(end - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        part_lo = lo + part * chunk
        part_hi = tl.minimum(part_lo + chunk, end)
        first = part_lo
    return first, part_lo, part_hi


@triton.jit
def key_tile(block_tables_ptr, req, stride_bt, start, part_lo, part_hi, BLOCK_SIZE: tl.constexpr,
             BLOCK_N: tl.constexpr, FIXED_CHUNK: tl.constexpr):
    """The tile of ``BLOCK_N`` keys from position ``start`` of request ``req``: which of them the part
    ``[part_lo, part_hi)`` sees, and where each sits in the paged cache (block, int64, and slot in it).
    Only a fixed chunk's first tile starts below ``part_lo`` (``part_range``), so only then is that
    bound checked."""
    offs_n = start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < part_hi
    if FIXED_CHUNK > 0:
        mask_n = mask_n & (offs_n >= part_lo)
    block = tl.load(block_tables_ptr + req * stride_bt + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    return mask_n, block, offs_n % BLOCK_SIZE


@triton.jit
def softmax_init(ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """The state of ``softmax_step`` before any key: max ``-inf [ROWS]``, denominator ``0 [ROWS]``,
    unnormalised output ``0 [ROWS, WIDTH]``, all float32."""
    return tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, WIDTH], tl.float32)


@triton.jit
def softmax_step(s, mask_n, values, m, denom, acc):
    """Fold one key tile into a running base-2 softmax: ``s [rows, TILE]`` the tile's scaled scores,
    ``mask_n`` its visible keys, ``values [TILE, D]`` (already in the ``tl.dot`` dtype); returns the new
    ``(max, denominator, unnormalised output)``."""
    s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile the kernels walk holds a visible key
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision="ieee")
    return m_new, denom, acc


@triton.jit
def store_part(out_ptr, part_out_ptr, part_lse_ptr, t, rows, num_rows, part, num_parts, offs_d, width, stride_ot,
               stride_oh, mask_rows, mask_d, m, denom, acc, DIRECT: tl.constexpr):
    """Write the normalised output of query rows ``rows`` (of ``num_rows``) of token ``t`` over part
    ``part`` of its keys: ``DIRECT``, the whole answer, to ``out``; else to the float32 partials ``[N,
    num_rows, num_parts, width]`` with its base-2 log-sum-exp (an empty part: zeros and ``-inf``, which the
    merges weigh as nothing)."""
    nonempty = denom > 0
    safe_denom = tl.where(nonempty, denom, 1.0)
    o = acc / safe_denom[:, None]
    store_mask = mask_rows[:, None] & mask_d[None, :]
    if DIRECT:
        tl.store(out_ptr + t * stride_ot + rows[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        row = (t * num_rows + rows) * num_parts + part
        tl.store(part_out_ptr + row[:, None] * width + offs_d[None, :], o, mask=store_mask)
        tl.store(part_lse_ptr + row, tl.where(nonempty, m + tl.log2(safe_denom), float("-inf")), mask=mask_rows)
