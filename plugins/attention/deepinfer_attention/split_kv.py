"""Split-KV (flash-decoding) pieces shared by the GQA and MLA decode kernels: how many splits a launch
uses, and the kernel that merges the splits' partial outputs by their log-sum-exps (the kernels' device
steps are in ``kernel_steps.py``).

Also ``dot_dtype``, the dtype the kernels feed ``tl.dot``, and ``tile_width``, the padded width of their tiles.

A query's visible keys are cut into ``num_splits`` chunks, each answered by its own program, so a batch
of one request still spreads over the whole GPU. Each program writes its normalised partial output and
its log-sum-exp in base 2 (``m + log2(l)``, the kernels work with ``exp2``); an empty chunk writes
``-inf`` and zeros, which the merge weighs as nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer.testing import triton_interpreting

LOG2E = 1.4426950408889634  # scores are scaled by log2(e) so the kernels can use exp2
MAX_SPLITS = 64
# Keys per split below which splitting further costs more (partials, merge) than it gains.
MIN_KEYS_PER_SPLIT = 256
# Programs per SM a launch aims for: two keeps every SM busy while the other's loads are in flight.
PROGRAMS_PER_SM = 2


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The operand dtype of the kernels' ``tl.dot``: the cache dtype on the GPU, float32 under Triton's
    interpreter, whose bf16 ``tl.dot`` (Triton 3.9) returns garbage that would hide real bugs."""
    return tl.float32 if triton_interpreting() else _TL_DTYPES[dtype]


def tile_width(dim: int, fp8: bool) -> int:
    """A kernel tile's padded width for rows of ``dim`` elements: a power of two, at least 16 (``tl.dot``'s
    minimum) and, over an FP8 cache, at least 32, so the tile splits into whole scale groups
    (``kernel_steps.load_fp8_tile``)."""
    return max(32 if fp8 else 16, triton.next_power_of_2(dim))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(work_units: int, max_kv_len: int, device: torch.device) -> int:
    """Splits per query for a launch with ``work_units`` programs before splitting (tokens × KV heads or
    head blocks) over a cache that holds at most ``max_kv_len`` keys per request (the block table's
    width × block size). Only shapes go in, so the choice is fixed for a CUDA graph's bucket."""
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    wanted = -(-PROGRAMS_PER_SM * sms // max(work_units, 1))
    by_length = -(-max_kv_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 partial outputs ``[N, H, num_splits, D]`` and log-sum-exps ``[N, H, num_splits]`` for
    a launch writing ``out [N, H, D]``; with one split the kernel writes ``out`` itself and both are
    ``out`` (placeholders the kernel never touches)."""
    if num_splits == 1:
        return out, out
    tokens, heads, width = out.shape
    return (torch.empty(tokens, heads, num_splits, width, dtype=torch.float32, device=out.device),
            torch.empty(tokens, heads, num_splits, dtype=torch.float32, device=out.device))


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, head_dim,
                  NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (token, head): ``out = Σ_s 2^(lse_s − max) · part_s / Σ_s 2^(lse_s − max)``."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = t * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < head_dim
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s, mask=mask_s, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_out_ptr + (row * NUM_SPLITS + offs_s[:, None]) * head_dim + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    merged = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, merged.to(out_ptr.dtype.element_ty), mask=mask_d)


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge ``part_out [N, H, S, D]`` (float32, each split normalised) with ``part_lse [N, H, S]``
    (float32, base 2) into ``out [N, H, D]`` (any float dtype, last dim contiguous)."""
    tokens, heads, splits, head_dim = part_out.shape
    _merge_kernel[(tokens, heads)](part_out, part_lse, out, out.stride(0), out.stride(1), head_dim,
                                   NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
                                   BLOCK_D=triton.next_power_of_2(head_dim))
