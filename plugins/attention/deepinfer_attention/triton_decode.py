"""Paged GQA attention for short query rows (decode and speculative verification), in Triton.

One program answers one query token for all query heads of one KV head (the GQA group, padded to 16
rows for ``tl.dot``) over one chunk of the token's visible keys, so each K/V tile is loaded once per
group; chunks are merged by ``split_kv.merge_splits``. A token at position ``p`` sees keys
``[max(0, p + 1 − window), p]`` of its request (all of ``[0, p]`` without a window): causal within a
request for any number of query tokens per request, provided this step's K/V are already in the cache.
With ``FIXED_CHUNK`` the same kernel cuts keys at absolute positions instead, for the batch-invariant
``batch_invariant_kernels.chunked_gqa_attention``.

With an FP8 cache (``deepinfer/kv/fp8.py``: e4m3 data, one UE8M0 scale byte per 32 elements of a head
vector) each K/V tile is read as one e4m3 tile and one ``[BLOCK_N, D / 32]`` tile of scale bytes and
dequantized exactly in registers (``kernel_steps.load_fp8_tile``: about 2.5 integer and bf16 instructions
per element, no conversion instruction), so the kernel reads 0.52× the bytes of a bf16 cache.

The kernel reads only device tensors (block tables, positions, the token → request map) and every
launch dimension comes from tensor shapes, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_attention import kernel_steps
from deepinfer_attention.split_kv import LOG2E, choose_num_splits, dot_dtype, merge_splits, split_buffers, tile_width


@triton.jit
def gqa_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, token_req_ptr,
                     positions_ptr, floor_ptr, out_ptr, part_out_ptr, part_lse_ptr, qk_scale, window, head_dim,
                     stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                     stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
                     stride_bt, stride_ot, stride_oh,
                     BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
                     HAS_TOKEN_REQ: tl.constexpr, HAS_FLOOR: tl.constexpr, FP8: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     FIXED_CHUNK: tl.constexpr = 0):
    """One program: token ``t``, KV head, part ``program_id(2)`` of the token's visible keys
    (``kernel_steps.part_range``: ``FIXED_CHUNK == 0``, one of ``NUM_SPLITS`` chunks from the shapes, the
    answer itself when there is one; ``FIXED_CHUNK > 0``, the chunk at absolute positions that
    ``batch_invariant_kernels`` merges in order, nothing written for a chunk outside the visible range)."""
    t = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    req = tl.load(token_req_ptr + t).to(tl.int64) if HAS_TOKEN_REQ else t
    end = tl.load(positions_ptr + t) + 1
    lo = tl.where(window > 0, tl.maximum(end - window, 0), 0)
    if HAS_FLOOR:  # bounded replay: with a window, keys below the floor are gone, except the query's own
        floor = tl.load(floor_ptr + req)
        lo = tl.where(window > 0, tl.maximum(lo, tl.minimum(floor, end - 1)), lo)
    first, part_lo, part_hi = kernel_steps.part_range(lo, end, part, NUM_SPLITS, FIXED_CHUNK, BLOCK_N)
    if FIXED_CHUNK > 0 and part_lo >= part_hi:  # outside the visible range: the ordered merge skips it
        return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < head_dim
    heads = kv_head * GROUP + offs_g
    q = kernel_steps.load_query(q_ptr, t, stride_qt, heads, stride_qh, offs_d, mask_g, mask_d, DOT_DTYPE)

    m, denom, acc = kernel_steps.softmax_init(BLOCK_G, BLOCK_D)
    for start in range(first, part_hi, BLOCK_N):
        mask_n, block, in_block = kernel_steps.key_tile(block_tables_ptr, req, stride_bt, start, part_lo, part_hi,
                                                        BLOCK_SIZE, BLOCK_N, FIXED_CHUNK)
        k, v = kernel_steps.load_kv_tiles(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block, in_block, kv_head, mask_n, offs_d, mask_d,
            head_dim, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ksb, stride_kss,
            stride_ksh, stride_vsb, stride_vss, stride_vsh, BLOCK_N, BLOCK_D, FP8, DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        m, denom, acc = kernel_steps.softmax_step(s, mask_n, v, m, denom, acc)

    num_parts = tl.num_programs(2) if FIXED_CHUNK > 0 else NUM_SPLITS
    kernel_steps.store_part(out_ptr, part_out_ptr, part_lse_ptr, t, heads, tl.num_programs(1) * GROUP, part, num_parts,
                            offs_d, head_dim, stride_ot, stride_oh, mask_g, mask_d, m, denom, acc,
                            DIRECT=FIXED_CHUNK == 0 and NUM_SPLITS == 1)


def paged_gqa_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        positions: torch.Tensor, token_req: torch.Tensor | None, *, scale: float, window: int = 0,
                        visibility_floor: torch.Tensor | None = None, num_splits: int | None = None,
                        block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                        k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q [N, Hq, D]`` over the paged cache ``k_cache, v_cache [blocks, block_size, Hkv, D]``
    (float8_e4m3fn with ``k_scales, v_scales [blocks, block_size, Hkv, ceil(D / 32)]``, UE8M0 bytes, for
    an FP8 cache; ``deepinfer/kv/fp8.py``).

    Token ``t`` belongs to request ``token_req[t]`` (``None``: request ``t``, one token per request),
    whose blocks are ``block_tables[req]``, and sits at ``positions[t]``; it sees its request's keys at
    positions ``≤ positions[t]`` (the last ``window`` of them when ``window > 0``, and then none below
    ``visibility_floor[req]`` but its own: ``ForwardContext.visibility_floor``). ``num_splits``:
    chunks per query (``None``: chosen from the shapes); ``block_n``: keys per tile (``None``: 16 KiB of K
    per tile as stored, at most 64 keys, so K and V tiles of two pipeline stages fit in shared memory even
    at ``D = 256`` in float32; 64 keys over an FP8 cache too, the fastest of 64 and 128 on the H200).
    Returns ``[N, Hq, D]`` in ``q.dtype``."""
    tokens, q_heads, head_dim = q.shape
    out = q.new_empty(tokens, q_heads, head_dim)
    if tokens == 0:
        return out
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    block_d = tile_width(head_dim, k_scales is not None)
    block_n = block_n or max(16, min(64, 16384 // (block_d * k_cache.element_size())))
    if num_splits is None:
        num_splits = choose_num_splits(tokens * kv_heads, block_tables.shape[1] * block_size, q.device)
    part_out, part_lse = split_buffers(out, num_splits)
    launch_gqa_kernel(q, k_cache, v_cache, block_tables, positions, token_req, out, part_out, part_lse, scale=scale,
                      window=window, visibility_floor=visibility_floor, num_parts=num_splits, block_n=block_n,
                      k_scales=k_scales, v_scales=v_scales, num_warps=num_warps or 4, num_stages=num_stages or 2)
    if num_splits > 1:
        merge_splits(part_out, part_lse, out)
    return out


def launch_gqa_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      positions: torch.Tensor, token_req: torch.Tensor | None, out: torch.Tensor,
                      part_out: torch.Tensor, part_lse: torch.Tensor, *, scale: float, window: int,
                      visibility_floor: torch.Tensor | None, num_parts: int, block_n: int, fixed_chunk: int = 0,
                      k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                      operand_dtype: torch.dtype | None = None, num_warps: int = 4, num_stages: int = 2) -> None:
    """One launch of ``gqa_split_kernel`` over ``num_parts`` parts of each token's keys
    (``fixed_chunk == 0``: ``num_parts`` splits from the shapes, the answer written to ``out`` when there
    is one; else chunks of ``fixed_chunk`` keys at absolute positions, always to the partials ``part_out
    [N, Hq, num_parts, D]``, ``part_lse [N, Hq, num_parts]``). Arguments as in ``paged_gqa_attention``;
    ``operand_dtype``: the dtype whose ``tl.dot`` operands the kernel uses (``None``: ``q``'s)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = q_heads // kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    fp8 = k_scales is not None and v_scales is not None
    ks, vs = (k_scales, v_scales) if fp8 else (k_cache, v_cache)  # unused by the kernel without FP8
    gqa_split_kernel[(tokens, kv_heads, num_parts)](
        q, k_cache, v_cache, ks, vs, block_tables, token_req if token_req is not None else positions, positions,
        visibility_floor if visibility_floor is not None else positions, out, part_out, part_lse, scale * LOG2E,
        window, head_dim,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, NUM_SPLITS=1 if fixed_chunk else num_parts,
        HAS_TOKEN_REQ=token_req is not None, HAS_FLOOR=visibility_floor is not None, FP8=fp8,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=tile_width(head_dim, fp8),
        BLOCK_N=block_n, DOT_DTYPE=dot_dtype(operand_dtype or q.dtype), FIXED_CHUNK=fixed_chunk,
        num_warps=num_warps, num_stages=num_stages)
