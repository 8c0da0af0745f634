"""Triton fused-expert kernels: two grouped GEMMs over a ``BlockLayout`` (``layout.py``).

``gate_up`` reads each row's token from ``x``, multiplies it by the block's expert ``w13`` (gate and up
halves as two accumulators) and writes ``silu(gate) · up`` for the pair — SwiGLU fused into the GEMM
epilogue, so the ``[P, 2I]`` product never reaches memory. ``down`` multiplies those rows by ``w2``
and scales each by its routing weight; the caller sums the ``k`` rows of a token.

FP8 (``FP8=True``): ``x``/``h`` are e4m3 with one float32 scale per row and 128 channels, weights are
e4m3 with one scale per 128×128 tile (``fp8.py``); ``BLOCK_K`` is 128, so each K step multiplies one
activation scale per row by one weight scale per output column, and accumulates in float32.

FP4 (``FP4=True``, DeepSeek-V4.1's stored experts, ``interfaces.Fp4ExpertWeights``): the weights are e2m1
codes two a byte (the even input index in the low nibble) with one ue8m0 scale per ``SCALE_BLOCK`` inputs;
each weight tile is dequantized in registers (``_weight_tile``: code → value by its bits, scale → ``2^(b-127)``
by its bits, their product exact in float32) and cast to the activations' dtype for ``tl.dot`` — exact in
bf16 — so no dequantized copy of the experts exists and a step reads half a byte per weight (plus 1/32).

Every launch reads only device memory and has a grid fixed by the shapes, so the step needs no host
sync and can be captured in a CUDA graph. Under ``TRITON_INTERPRET=1`` (the CPU tests) tiles are
upcast to float32 before ``tl.dot``: the interpreter (Triton 3.9) returns garbage for bf16 ``tl.dot``,
which would hide real bugs behind an interpreter one. On the GPU the cast is to the input dtype
itself, i.e. a no-op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.testing import triton_interpreting
from deepinfer_moe.layout import BlockLayout

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
              torch.float8_e4m3fn: tl.float8e4nv}
SCALE_BLOCK = 128


@triton.jit
def _e2m1_value(code):
    """float32 value of e2m1 codes (int32, 0..15): bit 3 the sign, ``ee = 0`` subnormal ``m·0.5``, else
    ``2^(ee-1)·(1 + m/2)`` — the same numbers as ``deepinfer.ops.dequantize_e2m1``'s table, the sign set
    as a bit (so code 8 is −0.0, as there)."""
    ee = (code >> 1) & 3
    half = (code & 1).to(tl.float32) * 0.5
    power = tl.where(ee == 1, 1.0, tl.where(ee == 2, 2.0, 4.0))
    magnitude = tl.where(ee == 0, half, power * (1.0 + half))
    sign = (code & 8) << 28  # bit 31
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_value(byte):
    """float32 ``2^(b-127)`` of ue8m0 bytes (int32) from the bits: 0 is the subnormal ``2^-127``, 255 NaN."""
    bits = tl.where(byte == 0, 1 << 22, tl.where(byte == 255, 0x7FC00000, byte << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _weight_tile(w_base, s_base, cols, k0, size_k, stride_wn, stride_sn, col_ok, BLOCK_K: tl.constexpr,
                 FP4: tl.constexpr, FP4_BLOCK: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` weight tile ``w[cols, k0:k0 + BLOCK_K]ᵀ`` of one expert (inputs past
    ``size_k`` and columns not ``col_ok`` read 0): loaded as stored, or with ``FP4`` dequantized to float32
    from its packed codes (``w_base`` bytes ``[N, K/2]``) and scales (``s_base`` bytes ``[N, K/FP4_BLOCK]``).
    FP4 reads each byte once, as a ``[BLOCK_K/2, BLOCK_N]`` tile contiguous along K, and each scale once
    (``[BLOCK_K/FP4_BLOCK, BLOCK_N]``); the low and high nibbles are interleaved back into input order."""
    col_offsets = cols[None, :].to(tl.int64)
    if FP4:
        HALF: tl.constexpr = BLOCK_K // 2
        GROUPS: tl.constexpr = BLOCK_K // FP4_BLOCK
        pairs = k0 // 2 + tl.arange(0, HALF)
        packed = tl.load(w_base + col_offsets * stride_wn + pairs[:, None],
                         mask=(pairs[:, None] * 2 < size_k) & col_ok[None, :], other=0).to(tl.int32)
        groups = k0 // FP4_BLOCK + tl.arange(0, GROUPS)
        scale = _ue8m0_value(tl.load(s_base + col_offsets * stride_sn + groups[:, None],
                                     mask=(groups[:, None] * FP4_BLOCK < size_k) & col_ok[None, :],
                                     other=127).to(tl.int32))  # [GROUPS, BLOCK_N]
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (GROUPS, FP4_BLOCK // 2, scale.shape[1])),
                           (HALF, scale.shape[1]))  # one row per byte row
        low = _e2m1_value(packed & 15) * scale  # inputs k0 + 2i
        high = _e2m1_value((packed >> 4) & 15) * scale  # inputs k0 + 2i + 1
        return tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (BLOCK_K, low.shape[1]))
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        return tl.load(w_base + col_offsets * stride_wn + kk[:, None], mask=(kk[:, None] < size_k) & col_ok[None, :],
                       other=0.0)


@triton.jit
def dequantize_fp4_kernel(w_ptr, s_ptr, out_ptr, rows, cols, stride_w, stride_s, stride_o,
                          FP4_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out [rows, cols]`` float32 = the FP4 matrix ``w [rows, cols/2]`` (scales ``s``) through
    ``_weight_tile``: what the GEMM kernels multiply, written out so a test can compare it bit for bit."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_C
    offs_c = k0 + tl.arange(0, BLOCK_C)
    tile = _weight_tile(w_ptr, s_ptr, offs_r, k0, cols, stride_w, stride_s, offs_r < rows, BLOCK_C, True,
                        FP4_BLOCK)  # [C, R]
    mask = (offs_c[:, None] < cols) & (offs_r[None, :] < rows)
    tl.store(out_ptr + offs_r[None, :].to(tl.int64) * stride_o + offs_c[:, None], tile, mask=mask)


@triton.jit
def _gate_up_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, pairs_ptr, block_expert_ptr,
    num_pairs, top_k, hidden, inter, limit,
    stride_xt, stride_we, stride_wn, stride_ot, stride_xst, stride_wse, stride_wsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, HAS_LIMIT: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr, FP4: tl.constexpr, FP4_BLOCK: tl.constexpr,
):
    """One program: ``BLOCK_M`` rows of one expert × ``BLOCK_N`` columns of the intermediate width."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a block past the last expert's rows: nothing to do
        return
    offs_m = tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:  # noqa: SIM108 (a constexpr branch) block p is pair p, its expert topk_ids[p] (pair_view)
        pair = tl.where(offs_m == 0, pid_m, num_pairs)
    else:
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + offs_m)
    row_ok = pair < num_pairs
    token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
    x_rows = x_ptr + token[:, None] * stride_xt
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < hidden
        a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        b_gate = _weight_tile(w_base, s_base, offs_n, k0, hidden, stride_wn, stride_wsn, col_ok, BLOCK_K, FP4,
                              FP4_BLOCK).to(DOT_DTYPE)  # [BLOCK_K, BLOCK_N]
        b_up = _weight_tile(w_base, s_base, offs_n + inter, k0, hidden, stride_wn, stride_wsn, col_ok, BLOCK_K, FP4,
                            FP4_BLOCK).to(DOT_DTYPE)
        if FP8:
            kb = k0 // BLOCK_K
            a_scale = tl.load(x_scale_ptr + token * stride_xst + kb, mask=row_ok, other=0.0)
            ws = w_scale_ptr + expert.to(tl.int64) * stride_wse + kb
            s_gate = tl.load(ws + (offs_n // 128) * stride_wsn, mask=col_ok, other=0.0)
            s_up = tl.load(ws + ((offs_n + inter) // 128) * stride_wsn, mask=col_ok, other=0.0)
            acc_gate += tl.dot(a, b_gate) * a_scale[:, None] * s_gate[None, :]
            acc_up += tl.dot(a, b_up) * a_scale[:, None] * s_up[None, :]
        else:
            acc_gate = tl.dot(a, b_gate, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
    if HAS_LIMIT:  # DeepSeek-V4's clamped SwiGLU
        acc_gate = tl.minimum(acc_gate, limit)
        acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # silu(gate) · up
    out = out_ptr + pair[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, h_scale_ptr, w_ptr, w_scale_ptr, out_ptr, weight_ptr, pairs_ptr, block_expert_ptr,
    num_pairs, hidden, inter,
    stride_hp, stride_we, stride_wn, stride_op, stride_hsp, stride_wse, stride_wsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
    FP4: tl.constexpr, FP4_BLOCK: tl.constexpr,
):
    """One program: ``BLOCK_M`` rows of one expert × ``BLOCK_N`` hidden columns, times routing weight."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:  # noqa: SIM108 (a constexpr branch) block p is pair p, its expert topk_ids[p] (pair_view)
        pair = tl.where(offs_m == 0, pid_m, num_pairs)
    else:
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + offs_m)
    row_ok = pair < num_pairs
    row = tl.where(row_ok, pair, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    s_base = w_scale_ptr + expert.to(tl.int64) * stride_wse
    h_rows = h_ptr + row[:, None] * stride_hp
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < inter
        a = tl.load(h_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        b = _weight_tile(w_base, s_base, offs_n, k0, inter, stride_wn, stride_wsn, col_ok, BLOCK_K, FP4,
                         FP4_BLOCK).to(DOT_DTYPE)
        if FP8:
            kb = k0 // BLOCK_K
            a_scale = tl.load(h_scale_ptr + row * stride_hsp + kb, mask=row_ok, other=0.0)
            s = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_wse + (offs_n // 128) * stride_wsn + kb,
                        mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * a_scale[:, None] * s[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    routing = tl.load(weight_ptr + row, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * routing[:, None]
    out = out_ptr + row[:, None] * stride_op + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _precision(dtype: torch.dtype) -> str | None:
    """float32 inputs multiply in full IEEE precision (not TF32), so fp32 runs match the reference;
    other dtypes keep ``tl.dot``'s default."""
    return "ieee" if dtype == torch.float32 else None


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    return tl.float32 if triton_interpreting() else _TL_DTYPES[dtype]


def gate_up(x: torch.Tensor, x_scale: torch.Tensor | None, w13: torch.Tensor, w13_scale: torch.Tensor | None,
            layout: BlockLayout, top_k: int, *, out_dtype: torch.dtype, block_n: int, block_k: int,
            num_warps: int, num_stages: int, swiglu_limit: float | None = None,
            fp4_block: int | None = None) -> torch.Tensor:
    """``silu(x·gateᵀ) · (x·upᵀ)`` for every pair: ``[P, I]`` in ``out_dtype``. ``x [T, H]`` (with
    ``x_scale [T, ⌈H/128⌉]`` when FP8), ``w13 [E, 2I, H]`` (with ``w13_scale`` when FP8; with ``fp4_block``
    the FP4 bytes ``[E, 2I, H/2]`` and their ue8m0 scales ``[E, 2I, H/fp4_block]``); ``swiglu_limit`` clamps
    gate ≤ limit and up to ``[-limit, limit]`` first."""
    fp8, fp4 = x_scale is not None, fp4_block is not None
    inter, hidden = w13.shape[1] // 2, w13.shape[2] * (2 if fp4 else 1)
    if fp8 and block_k != SCALE_BLOCK:
        raise ValueError(f"FP8 kernels need block_k == {SCALE_BLOCK} (one scale per K step), got {block_k}")
    if x.stride(1) != 1 or w13.stride(2) != 1:
        raise ValueError("gate_up needs x and w13 contiguous along the hidden dimension")
    out = torch.empty(layout.num_pairs, inter, dtype=out_dtype, device=x.device)
    scale_x = x_scale if fp8 else x  # any tensor: the pointer is not read when FP8 is off
    scale_w = w13_scale if w13_scale is not None else w13
    grid = (layout.num_blocks, triton.cdiv(inter, block_n))
    _gate_up_kernel[grid](
        x, scale_x, w13, scale_w, out, layout.pairs, layout.block_expert,
        layout.num_pairs, top_k, hidden, inter, 0.0 if swiglu_limit is None else float(swiglu_limit),
        x.stride(0), w13.stride(0), w13.stride(1), out.stride(0),
        scale_x.stride(0), scale_w.stride(0), scale_w.stride(1),
        BLOCK_M=layout.block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP8=fp8, DOT_DTYPE=_dot_dtype(x.dtype),
        PRECISION=_precision(x.dtype), HAS_LIMIT=swiglu_limit is not None, PAIR_BLOCKS=layout.one_pair_per_block,
        FP4=fp4, FP4_BLOCK=fp4_block or 1, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def down(h: torch.Tensor, h_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
         topk_weights: torch.Tensor, layout: BlockLayout, *, out_dtype: torch.dtype, block_n: int, block_k: int,
         num_warps: int, num_stages: int, fp4_block: int | None = None) -> torch.Tensor:
    """``topk_weight[p] · h[p] · w2[e]ᵀ`` for every pair ``p``: ``[P, H]`` in ``out_dtype`` (``w2``'s forms as
    ``gate_up``'s ``w13``)."""
    fp8, fp4 = h_scale is not None, fp4_block is not None
    hidden, inter = w2.shape[1], w2.shape[2] * (2 if fp4 else 1)
    if fp8 and block_k != SCALE_BLOCK:
        raise ValueError(f"FP8 kernels need block_k == {SCALE_BLOCK} (one scale per K step), got {block_k}")
    if h.stride(1) != 1 or w2.stride(2) != 1:
        raise ValueError("down needs h and w2 contiguous along the intermediate dimension")
    weights = topk_weights.reshape(-1).contiguous()
    out = torch.empty(layout.num_pairs, hidden, dtype=out_dtype, device=h.device)
    scale_h = h_scale if fp8 else h
    scale_w = w2_scale if w2_scale is not None else w2
    grid = (layout.num_blocks, triton.cdiv(hidden, block_n))
    _down_kernel[grid](
        h, scale_h, w2, scale_w, out, weights, layout.pairs, layout.block_expert,
        layout.num_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        scale_h.stride(0), scale_w.stride(0), scale_w.stride(1),
        BLOCK_M=layout.block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP8=fp8, DOT_DTYPE=_dot_dtype(h.dtype),
        PRECISION=_precision(h.dtype), PAIR_BLOCKS=layout.one_pair_per_block, FP4=fp4, FP4_BLOCK=fp4_block or 1,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``[rows, cols]`` float32 from FP4 bytes ``[rows, cols/2]`` and ue8m0 scales ``[rows, cols/block]``
    through the GEMM kernels' tile code (``dequantize_fp4_kernel``): for checking it against the core's
    ``dequantize_e2m1``."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(rows, cols, dtype=torch.float32, device=packed.device)
    grid = (triton.cdiv(rows, 16), triton.cdiv(cols, 64))
    dequantize_fp4_kernel[grid](packed, scales, out, rows, cols, packed.stride(0), scales.stride(0), out.stride(0),
                                FP4_BLOCK=block, BLOCK_R=16, BLOCK_C=64)
    return out


@triton.jit
def _sum_pairs_kernel(per_pair_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token × ``BLOCK_H`` columns: the sum of its ``TOP_K`` pair rows in float32, stored in the
    output's dtype."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(per_pair_ptr + (token * TOP_K + j) * hidden + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_pairs(per_pair: torch.Tensor, top_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``per_pair [T·k, H]`` (contiguous) → ``[T, H]`` in ``out_dtype``: each token's ``k`` rows added in
    float32 (one launch for what ``.sum(dtype=float32).to(dtype)`` does in two)."""
    hidden = per_pair.shape[1]
    tokens = per_pair.shape[0] // top_k
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=per_pair.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _sum_pairs_kernel[(tokens, triton.cdiv(hidden, block_h))](per_pair, out, hidden, TOP_K=top_k, BLOCK_H=block_h,
                                                             num_warps=4)
    return out
