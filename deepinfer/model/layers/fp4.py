"""The FP4 (e2m1) micro-scaled formats the DeepSeek-V4.1 reference stores, in plain torch.

Why here: the codec is a format, not a kernel. The V4.1 routed experts (``deepseek_v4/fp4_moe.py``), the
V4.1 KV layouts (``deepinfer/kv/v41_formats.py``) and any GPU backend in a plugin all read the same bytes,
so the definition and its CPU reference live once in the core, next to the other reference ops; a plugin's
kernel is checked against it.

Formats (reference/deepinfer.md §8 and §3; reference/kernels.md, FlashMLA's KV table):

- **e2m1** (OCP MX FP4): 4 bits ``s ee m``, exponent bias 1; ``ee = 0`` is subnormal (``m · 0.5``), else
  ``2^(ee-1) · (1 + m/2)``: the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (``E2M1_VALUES``). Two codes per byte,
  the even index in the low nibble (torch's ``float4_e2m1fn_x2``; FlashMLA's FP4 KV layout).
- **ue8m0** scales (``F8_E8M0``): one byte ``b``, value ``2^(b-127)``; ``b = 255`` is NaN. The routed experts
  use one per 32 consecutive values along the input dimension (``expert_dtype: fp4``: ``X.weight`` int8
  ``[out, in/2]``, ``X.scale`` F8_E8M0 ``[out, in/32]`` row-major), the index-K cache one per 32 too.
- **e4m3** scales: the FP4 main-KV layout (``use_fp4_sparse_kv``) has one ``float8_e4m3fn`` scale per 16
  values.

Dequantization is exact: an e2m1 magnitude has at most two significant bits and a scale is a power of two
(ue8m0) or has four (e4m3), so every product is representable in float32 (overflow is ±inf, as IEEE says),
and in bfloat16 too for ue8m0 scales.
"""

from __future__ import annotations

from typing import Literal

import torch

ScaleFormat = Literal["ue8m0", "e4m3"]

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each e2m1 code 0..15 (bit 3 the sign)."""
E2M1_MAX = 6.0

_E2M1_LUT = torch.tensor(E2M1_VALUES, dtype=torch.float32)


def _ue8m0_lut() -> torch.Tensor:
    """float32 ``2^(b-127)`` for every byte ``b``, built from the bits (no pow): ``b`` in 1..254 is the
    normal float with biased exponent ``b``; 0 is the subnormal ``2^-127``; 255 is NaN."""
    bits = torch.arange(256, dtype=torch.int32) << 23
    bits[0] = 1 << 22
    bits[255] = 0x7FC00000
    return bits.view(torch.float32)


_UE8M0_LUT = _ue8m0_lut()


def _bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` viewed as uint8 (int8, uint8 and one-byte float dtypes are accepted as raw bytes)."""
    if t.element_size() != 1 or (t.is_floating_point() and t.dtype not in (torch.float8_e8m0fnu,
                                                                          torch.float8_e4m3fn)):
        raise TypeError(f"{what}: expected one-byte storage (uint8/int8/float8), got {t.dtype}")
    return t.view(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., K]`` (integers 0..15, ``K`` even) → bytes ``uint8 [..., K/2]``, the even index in the
    low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: the last dimension must be even, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., K/2]`` (uint8 or int8) → codes ``uint8 [..., K]``, the inverse of ``pack_e2m1``."""
    b = _bytes(packed, "unpack_e2m1")
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of e2m1 codes (any integer dtype, 0..15)."""
    return _E2M1_LUT.to(codes.device)[codes.long()]


def ue8m0_values(scales: torch.Tensor) -> torch.Tensor:
    """float32 values ``2^(b-127)`` of ue8m0 bytes (uint8 or ``float8_e8m0fnu``); 255 → NaN."""
    return _UE8M0_LUT.to(scales.device)[_bytes(scales, "ue8m0_values").long()]


def scale_values(scales: torch.Tensor, fmt: ScaleFormat) -> torch.Tensor:
    """float32 values of stored scales: ``ue8m0`` bytes, or ``e4m3`` (``float8_e4m3fn``, or its bytes)."""
    if fmt == "ue8m0":
        return ue8m0_values(scales)
    if fmt == "e4m3":
        return _bytes(scales, "e4m3 scales").view(torch.float8_e4m3fn).float()
    raise ValueError(f"scale format {fmt!r}: expected 'ue8m0' or 'e4m3'")


def check_scale_shape(name: str, packed_shape: tuple[int, ...], scale_shape: tuple[int, ...], block: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``scale_shape`` is ``packed_shape`` with the last
    dimension ``2 · packed_shape[-1] / block`` (one scale per ``block`` values)."""
    values = 2 * packed_shape[-1]
    want = (*packed_shape[:-1], values // block)
    if values % block or tuple(scale_shape) != want:
        raise ValueError(f"{name}: scales of shape {tuple(scale_shape)} do not match packed e2m1 data of shape "
                         f"{tuple(packed_shape)} ({values} values per row, one scale per {block}: expected {want})")


def dequantize_e2m1(packed: torch.Tensor, scales: torch.Tensor, block: int = 32, fmt: ScaleFormat = "ue8m0",
                    dtype: torch.dtype = torch.bfloat16, name: str = "e2m1 tensor") -> torch.Tensor:
    """``packed [..., K/2]`` e2m1 bytes with ``scales [..., K/block]`` → ``[..., K]`` in ``dtype``:
    ``value(code) · scale`` computed exactly in float32, then cast (exact for bfloat16/float32 when
    in range). Scales of another shape raise ``ValueError`` naming ``name``."""
    check_scale_shape(name, tuple(packed.shape), tuple(scales.shape), block)
    values = e2m1_values(unpack_e2m1(packed))
    scaled = values.unflatten(-1, (-1, block)) * scale_values(scales, fmt).unsqueeze(-1)
    return scaled.flatten(-2).to(dtype)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The nearest e2m1 code of each value of ``x`` (already divided by its scale; ties to the even code,
    as IEEE round-to-nearest-even; beyond ±6 saturates to ±6; NaN is not representable and raises)."""
    if torch.isnan(x).any():
        raise ValueError("e2m1_codes: NaN has no e2m1 code")
    mag = x.abs().float()
    grid = _E2M1_LUT[:8].to(x.device)
    # Distance to every magnitude; on a tie argmin takes the first (smaller) one, so break ties to even codes.
    dist = (mag.unsqueeze(-1) - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    ties = dist == best
    even = ties & (torch.arange(8, device=x.device) % 2 == 0)
    code = torch.where(even.any(-1), even.int().argmax(-1), ties.int().argmax(-1)).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def quantize_e2m1(x: torch.Tensor, block: int = 32, fmt: ScaleFormat = "ue8m0"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` → ``(packed uint8 [..., K/2], scales [..., K/block])`` with each block's scale
    the smallest one that maps its largest magnitude to at most 6: ``ue8m0`` bytes (a power of two,
    ``2^ceil(log2(amax/6))``) or ``float8_e4m3fn`` (``amax/6`` rounded up to an e4m3 value). An all-zero
    block gets the smallest positive scale."""
    blocks = x.float().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(dim=-1)
    if fmt == "ue8m0":
        exp = torch.ceil(torch.log2(amax.clamp_min(2.0 ** -127 * E2M1_MAX) / E2M1_MAX)).clamp(-127, 127)
        stored = (exp + 127).to(torch.uint8)
    elif fmt == "e4m3":
        want = (amax / E2M1_MAX).clamp(min=2.0 ** -9, max=448.0)
        stored = want.to(torch.float8_e4m3fn)
        low = stored.float() < want  # rounded down: step one e4m3 value up so amax/scale stays within 6
        stored = torch.where(low, (stored.view(torch.uint8) + 1).view(torch.float8_e4m3fn), stored)
    else:
        raise ValueError(f"scale format {fmt!r}: expected 'ue8m0' or 'e4m3'")
    codes = e2m1_codes(blocks / scale_values(stored, fmt).unsqueeze(-1))
    return pack_e2m1(codes.flatten(-2)), stored
