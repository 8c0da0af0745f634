"""Triton kernels for DeepSeek-V4 attention: sparse sink attention and the lightning indexer's scores.

Both kernels serve query tokens of any rows — decode, speculative verification, prefill chunks — one
program per query token (and head block, or entry block): token ``t`` belongs to request
``token_req[t]`` (None: request ``t``, a decode-only batch) and sits at ``positions[t]``. They read
only device tensors: positions, state slots, block tables and selections are loaded inside the
kernels, loop bounds that depend on them are device values, and grids come from tensor shapes.
Importing this module imports triton; ``triton_v4.py`` does so only when a kernel runs.

Tiles enter ``tl.dot`` in the input dtype on the GPU (float32 accumulation; float32 inputs without
TF32). Under ``TRITON_INTERPRET=1`` they are upcast to float32 first: the interpreter (Triton 3.9)
returns garbage for bf16 ``tl.dot``, which would hide real bugs behind an interpreter one.

Formulas: ``deepinfer/model/layers/reference_deepseek_v4.py`` (the oracle), ``reference/deepinfer.md`` §8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.testing import triton_interpreting

_MIN_DOT = 16  # tl.dot needs every tile side ≥ 16
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# ``sink_attend``'s tiles, by "the queries are float32". 16-bit: the best of a sweep on the H200 (V4-Flash
# shape: 64 heads of 512, CSA top-512; 2,048-row prefill chunk at 32k and 64 decode rows at 32k): all 64
# heads in one program, so each key tile is loaded once per query, 1.7 ms and 0.16 ms against 8.4 and 0.33
# with 16 heads and Triton's default 3 stages (``docs/benchmarks.md``). Float32 (the tests' oracle runs):
# one stage, as more overflow the 227 KiB of shared memory at ``D`` = 512.
SINK_TILES = {False: {"block_h": 64, "block_n": 32, "num_warps": 8, "num_stages": 2},
              True: {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 1}}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype tiles enter ``tl.dot`` in (module docstring)."""
    if triton_interpreting():
        return tl.float32
    return _TL_DTYPES[dtype]


@triton.jit
def _dot(a, b, DOT_DTYPE: tl.constexpr):
    """``a @ b`` with both in ``DOT_DTYPE``, accumulated in float32; float32 without TF32."""
    if DOT_DTYPE == tl.float32:  # noqa: SIM300 (a constexpr comparison, resolved at compile time)
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision="ieee")
    return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _attend(q, k, ok, m, denom, acc, scale, DOT_DTYPE: tl.constexpr):
    """One online-softmax step over key tile ``k [N, D]`` (rows with ``ok`` false are ignored); keys are
    the values (MQA, K = V). ``m``/``denom``/``acc``: running max, denominator and numerator per head."""
    s = _dot(q, tl.trans(k), DOT_DTYPE) * scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: m starts at the sink logit
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(k.dtype), k, DOT_DTYPE)
    return m_new, denom, acc


@triton.jit
def _entry_keys(paged_ptr, table_row_ptr, e, ok, per_block, stride_b, stride_e, offs_d, d_ok):
    """Rows ``[N, D]`` of compressed entries ``e`` of one request (block table row ``table_row_ptr``) in a
    paged ``[num_blocks, per_block, D]`` tensor; zero where ``ok`` is false."""
    e = tl.where(ok, e, 0)
    blk = tl.load(table_row_ptr + e // per_block, mask=ok, other=0)
    rows = blk * stride_b + (e % per_block) * stride_e
    return tl.load(paged_ptr + rows[:, None] + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _sink_attention_kernel(
    q_ptr, kv_ptr, ring_ptr, comp_ptr, sel_ptr, table_ptr, slot_ptr, req_ptr, start_ptr, pos_ptr, floor_ptr,
    sink_ptr, out_ptr,
    stride_qt, stride_qh, stride_kt, stride_rs, stride_rr, stride_cb, stride_ce, stride_st, stride_bt, stride_ot,
    stride_oh, heads, dim, ring_size, per_block, scale,
    WINDOW: tl.constexpr, RATIO: tl.constexpr, TOPK: tl.constexpr, HAS_COMP: tl.constexpr,
    HAS_SEL: tl.constexpr, HAS_REQ: tl.constexpr, HAS_FLOOR: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Program (t, hb): query token t of request r, heads [hb·BLOCK_H, (hb+1)·BLOCK_H). Keys: the
    window's positions (p − WINDOW, p] — this step's from ``kv`` (row t − back, for the ``t − start[r]``
    newest: the request's query tokens are consecutive rows at consecutive positions), older ones from
    the ring of slot ``slot[r]`` (row position % ring_size, not yet overwritten by this step); with
    ``HAS_FLOOR`` only those at or above ``floor[r]``, and the query's own — then the compressed
    entries: ``sel[t]`` (−1 skipped) or every complete one."""
    t = tl.program_id(0)
    req = tl.load(req_ptr + t) if HAS_REQ else t
    first = tl.load(start_ptr + req) if HAS_REQ else t  # row of the request's first query token
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < heads
    d_ok = offs_d < dim
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + req)
    floor = tl.load(floor_ptr + req) if HAS_FLOOR else 0
    m = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)  # the sink: logit m, weight 1
    denom = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(0, WINDOW, BLOCK_N):
        back = start + offs_n
        key_pos = pos - back
        ok = (back < WINDOW) & (key_pos >= 0) & ((key_pos >= floor) | (back == 0))
        new = ok & (back <= t - first)
        old = ok & ~new
        rows = slot * stride_rs + (tl.where(old, key_pos, 0) % ring_size) * stride_rr
        k_old = tl.load(ring_ptr + rows[:, None] + offs_d[None, :], mask=old[:, None] & d_ok[None, :], other=0.0)
        k_new = tl.load(kv_ptr + tl.where(new, t - back, 0)[:, None] * stride_kt + offs_d[None, :],
                        mask=new[:, None] & d_ok[None, :], other=0.0)
        k = tl.where(new[:, None], k_new, k_old)
        m, denom, acc = _attend(q, k, ok, m, denom, acc, scale, DOT_DTYPE)
    if HAS_COMP:
        complete = (pos + 1) // RATIO
        if HAS_SEL:
            for start in range(0, TOPK, BLOCK_N):
                j = start + offs_n
                e = tl.load(sel_ptr + t * stride_st + j, mask=j < TOPK, other=-1)
                ok = (e >= 0) & (e < complete)
                k = _entry_keys(comp_ptr, table_ptr + req * stride_bt, e, ok, per_block, stride_cb, stride_ce,
                                offs_d, d_ok)
                m, denom, acc = _attend(q, k, ok, m, denom, acc, scale, DOT_DTYPE)
        else:
            for start in range(0, complete, BLOCK_N):
                e = start + offs_n
                ok = e < complete
                k = _entry_keys(comp_ptr, table_ptr + req * stride_bt, e, ok, per_block, stride_cb, stride_ce,
                                offs_d, d_ok)
                m, denom, acc = _attend(q, k, ok, m, denom, acc, scale, DOT_DTYPE)
    out = acc / denom[:, None]
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])


def sink_attend(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                sinks: torch.Tensor, *, window: int, scale: float, token_req: torch.Tensor | None = None,
                query_starts: torch.Tensor | None = None, floors: torch.Tensor | None = None,
                compressed: torch.Tensor | None = None, block_tables: torch.Tensor | None = None, ratio: int = 1,
                selected: torch.Tensor | None = None, block_n: int | None = None, block_h: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """V4 attention of any rows' query tokens (decode, verification, prefill chunks): ``q [T, H, D]``,
    ``kv [T, D]`` this step's keys; token t of request ``token_req[t]`` (None: request t, one token
    each) at ``positions[t]``, a request's tokens consecutive rows from ``query_starts[r]`` (``[B + 1]``,
    needed with ``token_req``) at consecutive positions; ``ring [slots, size, D]`` the keys before this
    step (``size ≥ window``; read only — the caller writes this step's keys afterwards), ``slots [B]``,
    ``sinks [H]``; ``floors [B]`` (or None) hides window keys below a request's floor but each query's
    own; ``compressed [num_blocks, per_block, D]`` with ``block_tables [B, max_blocks]`` or None;
    ``selected [T, k]`` the visible entries (distinct, −1: none) or None (every complete entry).
    Returns ``[T, H, D]`` in ``q.dtype``. Tiles and Triton's launch options: ``SINK_TILES`` of the dtype where
    not given."""
    rows, heads, dim = q.shape
    out = torch.empty_like(q)
    if rows == 0:
        return out
    if (ring.stride(2) != 1 or q.stride(2) != 1 or kv.stride(1) != 1
            or (compressed is not None and compressed.stride(2) != 1)):
        raise ValueError("sink_attend: q, kv, ring and compressed need a contiguous last (channel) axis")
    if token_req is not None and query_starts is None:
        raise ValueError("sink_attend: token_req needs query_starts")
    has_comp = compressed is not None
    has_sel = has_comp and selected is not None
    comp = compressed if compressed is not None else ring
    table = block_tables if block_tables is not None else slots.view(-1, 1)
    sel = selected if has_sel else positions.view(-1, 1)
    tiles = SINK_TILES[q.dtype == torch.float32]
    block_n = block_n or tiles["block_n"]
    block_h = max(_MIN_DOT, min(block_h or tiles["block_h"], triton.next_power_of_2(heads)))
    grid = (rows, triton.cdiv(heads, block_h))
    _sink_attention_kernel[grid](
        q, kv, ring, comp, sel, table, slots, positions if token_req is None else token_req,
        positions if query_starts is None else query_starts, positions, slots if floors is None else floors, sinks,
        out,
        q.stride(0), q.stride(1), kv.stride(0), ring.stride(0), ring.stride(1), comp.stride(0), comp.stride(1),
        sel.stride(0), table.stride(0), out.stride(0), out.stride(1),
        heads, dim, ring.shape[1], comp.shape[1], scale,
        WINDOW=window, RATIO=ratio, TOPK=sel.shape[1] if has_sel else 1, HAS_COMP=has_comp, HAS_SEL=has_sel,
        HAS_REQ=token_req is not None, HAS_FLOOR=floors is not None, BLOCK_H=block_h, BLOCK_N=max(_MIN_DOT, block_n),
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(dim)), DOT_DTYPE=dot_dtype(q.dtype),
        num_warps=num_warps or tiles["num_warps"], num_stages=num_stages or tiles["num_stages"],
    )
    return out


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, key_ptr, table_ptr, req_ptr, pos_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_ke, stride_bt, stride_ot,
    heads, dim, per_block, width, scale,
    RATIO: tl.constexpr, HAS_REQ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Program (t, nb): scores of query token t (of request r) for entries [nb·BLOCK_N, (nb+1)·BLOCK_N);
    −inf for entries that are not complete at the token's position."""
    t = tl.program_id(0)
    req = tl.load(req_ptr + t) if HAS_REQ else t
    e = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    pos = tl.load(pos_ptr + t)
    ok = e < (pos + 1) // RATIO
    k = _entry_keys(key_ptr, table_ptr + req * stride_bt, e, ok, per_block, stride_kb, stride_ke, offs_d, d_ok)
    total = tl.zeros([BLOCK_N], tl.float32)
    for h0 in range(0, heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs_h < heads
        q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_ok, other=0.0)
        s = tl.maximum(_dot(q, tl.trans(k), DOT_DTYPE), 0.0) * scale
        total += tl.sum(s * w[:, None], axis=0)
    tl.store(out_ptr + t * stride_ot + e, tl.where(ok, total, float("-inf")), mask=e < width)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, block_tables: torch.Tensor,
                 positions: torch.Tensor, *, ratio: int, scale: float, token_req: torch.Tensor | None = None,
                 block_n: int = 128, block_h: int = 32, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """Indexer scores of query tokens: ``q [T, heads, dim]``, ``weights [T, heads]`` float32, token t of
    request ``token_req[t]`` (None: request t) at ``positions[t]``; ``keys [num_blocks, per_block, dim]``
    paged with ``block_tables [B, max_blocks]``. Returns float32 ``[T, max_blocks · per_block]``:
    ``scale · Σ_h weights_h · relu(q_h · k_e)`` for complete entries ``e < (positions + 1) // ratio``,
    −inf elsewhere. Default tiles: the best of a sweep on the H200 (64 heads of 128, 8,192 entries; 2,048
    prefill rows 1.4 ms and 64 decode rows 0.10 ms, against 2.4 and 0.13 with 64 × 64 tiles)."""
    rows, heads, dim = q.shape
    width = block_tables.shape[1] * keys.shape[1]
    out = torch.empty(rows, width, dtype=torch.float32, device=q.device)
    if rows == 0 or width == 0:
        return out
    if q.stride(2) != 1 or keys.stride(2) != 1:
        raise ValueError("index_scores: q and keys need a contiguous last (channel) axis")
    block_n = max(_MIN_DOT, block_n)
    grid = (rows, triton.cdiv(width, block_n))
    _index_scores_kernel[grid](
        q, weights, keys, block_tables, positions if token_req is None else token_req, positions, out,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), keys.stride(1), block_tables.stride(0),
        out.stride(0), heads, dim, keys.shape[1], width, scale,
        RATIO=ratio, HAS_REQ=token_req is not None, BLOCK_H=max(_MIN_DOT, min(block_h, triton.next_power_of_2(heads))),
        BLOCK_N=block_n, BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(dim)), DOT_DTYPE=dot_dtype(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
