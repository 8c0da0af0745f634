"""``sorted_blocks`` (``layout.py``) in one Triton launch for small steps, with no sort.

The torch version sorts the ``P = T·k`` pairs (``argsort``: a radix sort), counts experts, takes two
prefix sums, scatters and searches: a dozen or more small launches per MoE layer. When ``P`` and
``E`` are small (decode batches), every program of this kernel instead holds the whole routing as a
one-hot ``[P, E]`` tile in registers: counts are its column sums, a pair's rank within its expert is a
column prefix sum, and each expert's padded run starts at a prefix sum of the padded counts. Each
program then fills its own slice of the layout: a row's pair is the one whose destination is that
row (a ``[rows, P]`` compare), a block's expert the number of expert runs that end at or before it.
Every program recomputes the (cheap) counts, so no program waits for another.

The result is exactly ``sorted_blocks``'s (the same stable order), so the GEMM kernels read it as
before. ``fits_small_layout`` says when the tile is small enough (``MAX_TILE`` one-hot cells).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_moe.layout import BlockLayout, max_blocks

MAX_TILE = 32768  # one-hot cells (padded P × padded E) a program holds; past it, the torch sort
_ROWS_PER_PROGRAM = 64


def fits_small_layout(num_pairs: int, num_experts: int) -> bool:
    """Whether ``small_sorted_blocks`` serves ``num_pairs`` pairs over ``num_experts`` experts."""
    return num_pairs > 0 and triton.next_power_of_2(num_pairs) * triton.next_power_of_2(num_experts) <= MAX_TILE


@triton.jit
def _sorted_layout_kernel(
    ids_ptr, pairs_ptr, block_expert_ptr, num_pairs, num_experts, num_rows, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr,
):
    """Rows ``[pid·ROWS, (pid+1)·ROWS)`` of ``pairs`` and their blocks' experts."""
    pid = tl.program_id(0)
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < num_pairs
    offs_e = tl.arange(0, BLOCK_E)
    ids = tl.load(ids_ptr + offs_p, mask=p_ok, other=-1).to(tl.int32)
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [BLOCK_P, BLOCK_E]
    counts = tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)
    run_start = run_end - padded
    earlier = tl.cumsum(onehot, axis=0) - onehot  # pairs of each expert before this one (stable rank)
    dest = tl.sum(onehot * (earlier + run_start[None, :]), axis=1)
    dest = tl.where(p_ok, dest, -1)
    rows = pid * ROWS + tl.arange(0, ROWS)
    match = dest[None, :] == rows[:, None]  # [ROWS, BLOCK_P]: at most one pair per row
    pair = tl.sum(tl.where(match, offs_p[None, :], 0), axis=1)
    hit = tl.max(match.to(tl.int32), axis=1) > 0
    tl.store(pairs_ptr + rows, tl.where(hit, pair, num_pairs), mask=rows < num_rows)
    blocks = pid * (ROWS // BLOCK_M) + tl.arange(0, ROWS // BLOCK_M)
    ended = (run_end[None, :] <= blocks[:, None] * BLOCK_M) & (offs_e[None, :] < num_experts)
    expert = tl.sum(ended.to(tl.int32), axis=1)  # searchsorted(run_end, block start, right=True)
    tl.store(block_expert_ptr + blocks, tl.where(expert < num_experts, expert, -1), mask=blocks < num_blocks)


def small_sorted_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockLayout:
    """``sorted_blocks(topk_ids, num_experts, block_m)`` in one launch; needs ``fits_small_layout``."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    num_rows = num_blocks * block_m
    pairs = torch.empty(num_rows, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    rows_per_program = max(block_m, _ROWS_PER_PROGRAM)
    _sorted_layout_kernel[(triton.cdiv(num_rows, rows_per_program),)](
        flat, pairs, block_expert, num_pairs, num_experts, num_rows, num_blocks,
        BLOCK_M=block_m, BLOCK_P=triton.next_power_of_2(num_pairs), BLOCK_E=triton.next_power_of_2(num_experts),
        ROWS=rows_per_program, num_warps=4,
    )
    return BlockLayout(pairs, block_expert, block_m, num_pairs)
