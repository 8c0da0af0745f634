"""The FP8 cache write in one Triton launch per cache tensor: quantize each cached vector (``deepinfer/kv/fp8.py``:
e4m3 data, one UE8M0 scale byte per 32 elements) and store it at its slot.

The core's torch write (``fp8.store``) takes a dozen elementwise kernels per tensor; here one program per
(token, row) loads the row, takes each group's amax, derives the scale byte exactly as ``fp8.quantize`` does
(``div_rn``: the IEEE division torch uses) and writes the e4m3 bit patterns it computes itself, rounding to
nearest even as a ``float8_e4m3fn`` cast does, so the bytes equal the torch path's (also under Triton's
interpreter, whose own float8 cast rounds differently). No host reads: it is captured with the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops import fp8


@triton.jit
def _e4m3_bits(v):
    """The e4m3 bit pattern of float32 ``v`` (``|v| ≤ 448``), rounded to nearest even."""
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)  # 23 → 3 mantissa bits, ties to even; carries into the exponent
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)  # e4m3 exponent bias 7 (float32's 127)
    steps = a * 512.0  # below 2^-6: subnormal multiples of 2^-9
    whole = steps.to(tl.int32)
    frac = steps - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    subnormal = whole + up.to(tl.int32)
    return tl.where(a < 0.015625, subnormal, normal) | sign


@triton.jit
def _store_kernel(x_ptr, slot_ptr, data_ptr, scale_ptr, dim, min_amax, stride_xt, stride_xr, stride_ds, stride_dr,
                  stride_ss, stride_sr, BLOCK_G: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    col = offs_g[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask = col < dim
    x = tl.load(x_ptr + t * stride_xt + r * stride_xr + col, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), min_amax)
    bits = tl.math.div_rn(amax, 448.0).to(tl.int32, bitcast=True)
    byte = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2(amax / 448)) + 127
    inv_scale = ((254 - byte) << 23).to(tl.float32, bitcast=True)
    scaled = tl.minimum(tl.maximum(x * inv_scale[:, None], -448.0), 448.0)
    tl.store(data_ptr + slot * stride_ds + r * stride_dr + col, _e4m3_bits(scaled).to(tl.uint8), mask=mask)
    tl.store(scale_ptr + slot * stride_ss + r * stride_sr + offs_g, byte.to(tl.uint8), mask=offs_g * 32 < dim)


def store_fp8(data_cache: torch.Tensor, scale_cache: torch.Tensor, slot_mapping: torch.Tensor,
              x: torch.Tensor) -> None:
    """``fp8.store`` in one launch: quantize ``x [T, ..., D]`` and write it at flat slots ``slot_mapping [T]``
    of ``data_cache [blocks, block_size, ..., D]`` (float8_e4m3fn; a column slice of a wider row is fine)
    and ``scale_cache [blocks, block_size, ..., ceil(D / 32)]`` (uint8)."""
    tokens, dim = x.shape[0], x.shape[-1]
    if tokens == 0:
        return
    rows = x.reshape(tokens, -1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    data = data_cache.view(torch.uint8).view(-1, rows.shape[1], dim)
    scales = scale_cache.view(-1, rows.shape[1], scale_cache.shape[-1])
    _store_kernel[(tokens, rows.shape[1])](
        rows, slot_mapping, data, scales, dim, fp8.MIN_AMAX, rows.stride(0), rows.stride(1), data.stride(0),
        data.stride(1), scales.stride(0), scales.stride(1), BLOCK_G=triton.next_power_of_2(fp8.num_groups(dim)))


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor) -> None:
    """The core's ``write_kv`` for an FP8 GQA cache ``(k, v, k_scales, v_scales)``: two launches."""
    store_fp8(kv_cache[0], kv_cache[2], slot_mapping, k)
    store_fp8(kv_cache[1], kv_cache[3], slot_mapping, v)


def store_latent(latent: torch.Tensor, k_pe: torch.Tensor, cache: tuple[torch.Tensor, ...],
                 slot_mapping: torch.Tensor) -> None:
    """The core's ``write_latent`` for an FP8 MLA cache ``(rows, scales)``: the latent and the rope key each
    in their own groups (``PagedLatentSpec``), two launches."""
    rows, scales = cache
    latent_dim, split = latent.shape[1], fp8.num_groups(latent.shape[1])
    store_fp8(rows[..., :latent_dim], scales[..., :split], slot_mapping, latent)
    store_fp8(rows[..., latent_dim:], scales[..., split:], slot_mapping, k_pe)
