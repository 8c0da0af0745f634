"""The FP8 KV-cache format (``cache.kv_dtype: fp8``): MXFP8-style rows, quantized on write.

A cached vector of ``D`` elements (a GQA head's key or value, or an MLA latent row ``[c, k_pe]``) is cut
into ``ceil(D / 32)`` consecutive groups of 32 (the last one shorter when ``D`` is not a multiple of 32);
each group is stored as float8 e4m3 (``float8_e4m3fn``, largest finite value 448) with one shared
power-of-two scale, kept as a UE8M0 byte: ``scale = 2^(byte − 127)`` — the reference's SWA and compressed
KV format (``reference/deepinfer.md §3``: 512 e4m3 + 16 UE8M0 per-32 scales = 528 B per row).

Why UE8M0 bytes rather than float32 scales: one byte per 32 elements costs 3% over the data (float32
would cost 12.5%), so the cache holds ≈1.94× the tokens of bf16 at ``D = 128`` (1.78× with float32);
a power-of-two scale makes ``x / scale`` exact, so the only error is e4m3's own rounding; and kernels
rebuild the scale exactly from the byte by placing it in a float32's exponent field.

The scale is ``2^ceil(log2(amax / 448))`` (``amax``: the group's largest magnitude), the smallest power of
two that keeps every scaled element within e4m3's range, so nothing saturates. Per element the stored
value is then within half an e4m3 step: ``|x − x̂| ≤ 2^-4·|x|`` for scaled magnitudes in e4m3's normal range
(≥ 2^-6), and ``≤ 2^-10·scale`` below it (subnormals). An all-zero group gets a tiny scale and stores zeros.

Layout: the data tensor keeps the model's shape with dtype ``float8_e4m3fn``; the scales live in a
parallel ``uint8`` tensor whose last dimension is ``groups(D)`` (``kv/specs.py``). Copies go through a
``uint8`` view: CPU ``index_copy_`` has no float8 kernel.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 32
E8M0_BIAS = 127
# Magnitudes are floored here before the scale is derived, so an all-zero group gets a normal float32
# ``amax / 448`` (a finite, representable scale byte) and no division by zero; part of the format, so a
# kernel that writes it (plugins/attention's fp8_store) derives the same bytes.
MIN_AMAX = 2.0 ** -100

# ``cache.kv_dtype: fp4`` has no torch dtype of its own: torch's packed e2m1 dtype stands for it, so the pool
# and the specs carry one value; only DeepSeek-V4.1's cache parts accept it (``kv/v41_cache.py``).
FP4_KV_DTYPE = torch.float4_e2m1fn_x2
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE, "fp4": FP4_KV_DTYPE}


def kv_storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype paged KV rows are stored in for ``cache.kv_dtype`` (``auto``: the model's dtype; ``fp4``:
    ``FP4_KV_DTYPE``, which names V4.1's layouts, ``kv/v41_cache.py``). Which model reads which value is
    the cache specs' business (``kv/pools.check_kv_dtype``)."""
    if kv_dtype == "auto":
        return model_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"cache.kv_dtype={kv_dtype!r}: allowed values are 'auto', 'bf16', 'fp8', 'fp4'")
    return KV_DTYPES[kv_dtype]


def num_groups(dim: int) -> int:
    """Scale bytes per row of ``dim`` elements."""
    return -(-dim // GROUP)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` (any float dtype) → ``(data [..., D] float8_e4m3fn, scales [..., groups(D)] uint8)``.

    Plain torch ops with no host reads, so the write path stays capturable in a CUDA graph."""
    dim = x.shape[-1]
    groups = num_groups(dim)
    xf = x.float()
    if groups * GROUP != dim:
        xf = torch.nn.functional.pad(xf, (0, groups * GROUP - dim))
    xg = xf.unflatten(-1, (groups, GROUP))
    amax = xg.abs().amax(-1).clamp(min=MIN_AMAX)
    # ceil(log2(amax / 448)) read off the float32 bits: the biased exponent, plus one unless the
    # mantissa is zero (an exact power of two).
    bits = (amax / FP8_MAX).view(torch.int32)
    byte = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    inv_scale = ((2 * E8M0_BIAS - byte) << 23).view(torch.float32)  # 2^-(byte − 127), exact
    data = (xg * inv_scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[..., :dim].to(FP8_DTYPE)
    return data, byte.to(torch.uint8)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes → their float32 powers of two (exact)."""
    return (scales.to(torch.int32) << 23).view(torch.float32)


def dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(data [..., D], scales [..., groups(D)])`` → ``[..., D]`` in ``dtype``."""
    dim = data.shape[-1]
    per_element = scale_values(scales).repeat_interleave(GROUP, dim=-1)[..., :dim]
    return (data.float() * per_element).to(dtype)


def store(data_cache: torch.Tensor, scale_cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Quantize ``x [T, ...]`` and write it at flat cache slots ``slot_mapping [T]`` of ``data_cache
    [blocks, block_size, ...]`` and ``scale_cache`` (same leading shape, last dim ``groups``)."""
    data, scales = quantize(x)
    data_cache.view(torch.uint8).view(-1, *data_cache.shape[2:]).index_copy_(0, slot_mapping, data.view(torch.uint8))
    scale_cache.view(-1, *scale_cache.shape[2:]).index_copy_(0, slot_mapping, scales)


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as it reads back from an FP8 cache (quantized, then dequantized to ``x.dtype``): what a
    prefill attends to when its fresh keys skip the cache, so it sees the values decode will read
    (``reference/deepinfer.md §3``, prefill KV assembly, ``cast_back``)."""
    return dequantize(*quantize(x), x.dtype)


def gather(data: torch.Tensor, scales: torch.Tensor | None, block_table: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor:
    """Rows of ``block_table``'s blocks (``[..., n]`` ids) from a cache tensor ``[blocks, block_size, ...]``,
    as ``[..., n·block_size, ...]`` in ``dtype``: dequantized with ``scales`` when the data is FP8, else
    cast (a no-op when the cache is already in ``dtype``). ``index_select`` copies whole blocks and is
    several times faster than advanced indexing on CPU."""
    ids = block_table.reshape(-1)
    rows = data.index_select(0, ids).view(*block_table.shape[:-1], -1, *data.shape[2:])
    if scales is None:
        return rows.to(dtype)
    row_scales = scales.index_select(0, ids).view(*block_table.shape[:-1], -1, *scales.shape[2:])
    return dequantize(rows, row_scales, dtype)
