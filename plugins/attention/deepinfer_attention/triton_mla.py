"""Paged MLA attention in the weight-absorbed form for short query rows (decode and speculative
verification), in Triton.

Every head attends with ``[q_lat, q_pe]`` (``q_lat = q_nope · W_UK``, latent width ``C``; rotated rope
part, width ``R``) against the one cached row per token ``[c, k_pe]`` shared by all heads, and the
value is the latent ``c`` itself (``reference_deepseek.py`` describes the layout). One program answers
one query token for a block of heads over one chunk of the visible keys, so each latent tile is loaded
once per head block; chunks are merged by ``split_kv.merge_splits``. The result stays in latent space
(``[N, H, C]``); the caller applies ``W_UV``. With ``FIXED_CHUNK`` the same kernel cuts keys at absolute
positions instead, for the batch-invariant ``batch_invariant_kernels.chunked_mla_attention``.

With an FP8 cache (``deepinfer/kv/fp8.py``: the whole row ``[c, k_pe]`` in e4m3, one UE8M0 scale byte per
32 elements, groups restarting at ``k_pe``: ``PagedLatentSpec``) each tile's latent and rope parts are
read as e4m3 tiles with their ``[BLOCK_N, groups]`` scale bytes and dequantized exactly in registers
(``kernel_steps.load_fp8_tile``); the dequantized latent serves as both key and value.

The kernel reads only device tensors and every launch dimension comes from tensor shapes, so it can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_attention import kernel_steps
from deepinfer_attention.split_kv import LOG2E, choose_num_splits, dot_dtype, merge_splits, split_buffers, tile_width


@triton.jit
def mla_split_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, scale_ptr, block_tables_ptr, token_req_ptr, positions_ptr,
                     out_ptr, part_out_ptr, part_lse_ptr, qk_scale, num_heads, latent_dim, rope_dim,
                     stride_lt, stride_lh, stride_pt, stride_ph, stride_cb, stride_cs, stride_sb, stride_ss,
                     stride_bt, stride_ot, stride_oh,
                     BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_TOKEN_REQ: tl.constexpr,
                     FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, FIXED_CHUNK: tl.constexpr = 0):
    """One program: token ``t``, a block of ``BLOCK_H`` heads, part ``program_id(2)`` of the token's keys
    ``[0, p]``, cut as in ``triton_decode.gqa_split_kernel`` (``kernel_steps.part_range``)."""
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    part = tl.program_id(2)
    req = tl.load(token_req_ptr + t).to(tl.int64) if HAS_TOKEN_REQ else t
    end = tl.load(positions_ptr + t) + 1
    first, part_lo, part_hi = kernel_steps.part_range(0, end, part, NUM_SPLITS, FIXED_CHUNK, BLOCK_N)
    if FIXED_CHUNK > 0 and part_lo >= part_hi:  # outside the visible range: the ordered merge skips it
        return

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = heads < num_heads
    mask_c = offs_c < latent_dim
    mask_r = offs_r < rope_dim
    q_lat = kernel_steps.load_query(q_lat_ptr, t, stride_lt, heads, stride_lh, offs_c, mask_h, mask_c, DOT_DTYPE)
    q_pe = kernel_steps.load_query(q_pe_ptr, t, stride_pt, heads, stride_ph, offs_r, mask_h, mask_r, DOT_DTYPE)

    m, denom, acc = kernel_steps.softmax_init(BLOCK_H, BLOCK_C)
    for start in range(first, part_hi, BLOCK_N):
        mask_n, block, in_block = kernel_steps.key_tile(block_tables_ptr, req, stride_bt, start, part_lo, part_hi,
                                                        BLOCK_SIZE, BLOCK_N, FIXED_CHUNK)
        row = block * stride_cb + in_block * stride_cs
        if FP8:
            scale_row = scale_ptr + block * stride_sb + in_block * stride_ss
            latent = kernel_steps.load_fp8_tile(cache_ptr + row, scale_row, mask_n, latent_dim, BLOCK_N, BLOCK_C,
                                                DOT_DTYPE, TWO_USES=True)
            rope = kernel_steps.load_fp8_tile(cache_ptr + row + latent_dim, scale_row + tl.cdiv(latent_dim, 32), mask_n,
                                              rope_dim, BLOCK_N, BLOCK_R, DOT_DTYPE)
        else:
            latent_mask = mask_n[:, None] & mask_c[None, :]
            rope_mask = mask_n[:, None] & mask_r[None, :]
            latent = tl.load(cache_ptr + row[:, None] + offs_c[None, :], mask=latent_mask, other=0.0).to(DOT_DTYPE)
            rope = tl.load(cache_ptr + row[:, None] + latent_dim + offs_r[None, :], mask=rope_mask,
                           other=0.0).to(DOT_DTYPE)
        s = tl.dot(q_lat, tl.trans(latent), input_precision="ieee")
        s = tl.dot(q_pe, tl.trans(rope), s, input_precision="ieee") * qk_scale
        m, denom, acc = kernel_steps.softmax_step(s, mask_n, latent, m, denom, acc)

    num_parts = tl.num_programs(2) if FIXED_CHUNK > 0 else NUM_SPLITS
    kernel_steps.store_part(out_ptr, part_out_ptr, part_lse_ptr, t, heads, num_heads, part, num_parts, offs_c,
                            latent_dim, stride_ot, stride_oh, mask_h, mask_c, m, denom, acc,
                            DIRECT=FIXED_CHUNK == 0 and NUM_SPLITS == 1)


def default_block_h(num_heads: int) -> int:
    """Heads per program: 16 (``tl.dot``'s minimum) up to 16 heads, else 32 — a latent tile then serves
    32 heads while the ``[32, C]`` float32 accumulator still fits in registers at ``C = 512``."""
    return 16 if num_heads <= 16 else 32


def paged_mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        positions: torch.Tensor, token_req: torch.Tensor | None, *, scale: float,
                        num_splits: int | None = None, block_h: int | None = None, block_n: int | None = None,
                        num_warps: int | None = None, num_stages: int | None = None,
                        scales: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA of ``q_lat [N, H, C]`` and ``q_pe [N, H, R]`` over the paged latent cache
    ``cache [blocks, block_size, C + R]`` (rows ``[c, k_pe]``; float8_e4m3fn with ``scales [blocks,
    block_size, ceil(C / 32) + ceil(R / 32)]``, UE8M0 bytes, for an FP8 cache, ``deepinfer/kv/fp8.py``); values are
    the rows' first ``C`` entries.

    Token ``t`` belongs to request ``token_req[t]`` (``None``: request ``t``) and sits at
    ``positions[t]``; it sees its request's rows at positions ``≤ positions[t]``. ``num_splits``: chunks
    per query (``None``: chosen from the shapes); ``block_h``: heads per program (``default_block_h``);
    ``block_n``: keys per tile (``None``: 32 KiB of latent per tile as stored, 32 keys at ``C = 512`` in
    bf16, 64 in FP8); ``num_warps``: ``None``, 4 for one block of 16 heads over a bf16 cache, else 8 (an
    FP8 tile is dequantized in registers for both products, which spills at 4 warps).
    Returns the latent output ``[N, H, C]`` in ``q_lat.dtype``."""
    tokens, num_heads, latent_dim = q_lat.shape
    out = q_lat.new_empty(tokens, num_heads, latent_dim)
    if tokens == 0:
        return out
    block_h = block_h or default_block_h(num_heads)
    block_c = tile_width(latent_dim, scales is not None)
    block_n = block_n or max(16, min(64, 32768 // (block_c * cache.element_size())))
    if num_splits is None:
        num_splits = choose_num_splits(tokens * triton.cdiv(num_heads, block_h), block_tables.shape[1] * cache.shape[1],
                                       q_lat.device)
    part_out, part_lse = split_buffers(out, num_splits)
    launch_mla_kernel(q_lat, q_pe, cache, block_tables, positions, token_req, out, part_out, part_lse, scale=scale,
                      num_parts=num_splits, block_h=block_h, block_n=block_n, scales=scales, num_warps=num_warps,
                      num_stages=num_stages or 2)
    if num_splits > 1:
        merge_splits(part_out, part_lse, out)
    return out


def launch_mla_kernel(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      positions: torch.Tensor, token_req: torch.Tensor | None, out: torch.Tensor,
                      part_out: torch.Tensor, part_lse: torch.Tensor, *, scale: float, num_parts: int, block_h: int,
                      block_n: int, fixed_chunk: int = 0, scales: torch.Tensor | None = None,
                      operand_dtype: torch.dtype | None = None, num_warps: int | None = None,
                      num_stages: int = 2) -> None:
    """One launch of ``mla_split_kernel`` over ``num_parts`` parts of each token's keys, cut as in
    ``triton_decode.launch_gqa_kernel`` (``fixed_chunk``). Arguments as in ``paged_mla_attention``;
    ``operand_dtype``: the dtype whose ``tl.dot`` operands the kernel uses (``None``: ``q_lat``'s)."""
    tokens, num_heads, latent_dim = q_lat.shape
    rope_dim = q_pe.shape[2]
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    row_scales = scales if scales is not None else cache  # unused by the kernel without FP8
    mla_split_kernel[(tokens, triton.cdiv(num_heads, block_h), num_parts)](
        q_lat, q_pe, cache, row_scales, block_tables, token_req if token_req is not None else positions, positions,
        out, part_out, part_lse, scale * LOG2E, num_heads, latent_dim, rope_dim,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1),
        row_scales.stride(0), row_scales.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=cache.shape[1], NUM_SPLITS=1 if fixed_chunk else num_parts, HAS_TOKEN_REQ=token_req is not None,
        FP8=scales is not None, BLOCK_H=block_h, BLOCK_C=tile_width(latent_dim, scales is not None),
        BLOCK_R=tile_width(rope_dim, scales is not None), BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype(operand_dtype or q_lat.dtype), FIXED_CHUNK=fixed_chunk,
        num_warps=num_warps or (4 if block_h <= 16 and scales is None else 8), num_stages=num_stages)
