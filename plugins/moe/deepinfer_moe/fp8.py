"""FP8 (e4m3) block quantization for expert weights and per-token-group quantization for activations.

The format is DeepSeek-V3's (and DeepGEMM's on SM90): weights ``[.., N, K]`` in ``float8_e4m3fn`` with
one float32 scale per 128×128 block, ``scale [.., ⌈N/128⌉, ⌈K/128⌉]``; activations ``[M, K]`` with one
float32 scale per token and 128 consecutive channels, ``scale [M, ⌈K/128⌉]``. A scale is the
*dequantization* multiplier (value ≈ fp8 · scale), the quantity HF checkpoints store as
``weight_scale_inv``. Scales are ``amax / 448`` (448 is e4m3's largest finite value), so every block
uses the whole e4m3 range. Everything here is plain torch: it runs on CPU and GPU, needs no host sync,
and is the oracle for the kernels that read this format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
# A block of zeros gets this scale instead of 0, so dividing by it stays finite (its values are 0 anyway).
_MIN_SCALE = 1e-12


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """``amax / 448``, or with ``pow2`` the next power of two above it (UE8M0 scales, which SM100's
    DeepGEMM kernels read; a power-of-two scale converts to UE8M0 without changing the values)."""
    scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    return torch.exp2(torch.ceil(torch.log2(scale))) if pow2 else scale


def quantize_weight_blocks(w: torch.Tensor, block: int = BLOCK, pow2: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` (any float dtype) → ``(q [..., N, K] e4m3, scale [..., ⌈N/b⌉, ⌈K/b⌉] float32)``,
    one scale per ``block × block`` tile (partial tiles at the edges get their own scale)."""
    *lead, n, k = w.shape
    nb, kb = _cdiv(n, block), _cdiv(k, block)
    padded = w.new_zeros(*lead, nb * block, kb * block, dtype=torch.float32)
    padded[..., :n, :k] = w
    tiles = padded.view(*lead, nb, block, kb, block)
    scale = _scale(tiles.abs().amax(dim=(-3, -1)), pow2)  # [..., nb, kb]
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, nb * block, kb * block)[..., :n, :k].contiguous(), scale


def dequantize_weight_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_weight_blocks``: ``q [..., N, K]`` · its tile's scale, in ``dtype``."""
    n, k = q.shape[-2:]
    full = scale.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]
    return (q.float() * full).to(dtype)


def quantize_rows(x: torch.Tensor, group: int = BLOCK, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → ``(q [M, K] e4m3, scale [M, ⌈K/group⌉] float32)``: one scale per row and ``group``
    consecutive channels (the activation side of the 1×128 / 128×128 recipe)."""
    m, k = x.shape
    kb = _cdiv(k, group)
    if k % group:
        padded = x.new_zeros(m, kb * group, dtype=torch.float32)
        padded[:, :k] = x
    else:
        padded = x.float()
    groups = padded.view(m, kb, group)
    scale = _scale(groups.abs().amax(dim=-1), pow2)
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, kb * group)[:, :k].contiguous(), scale


@dataclass(frozen=True)
class Fp8Experts:
    """Routed-expert weights in the 128×128 block-scaled FP8 format.

    ``w13 [E, 2I, H]`` (gate rows then up rows) with ``w13_scale [E, ⌈2I/128⌉, ⌈H/128⌉]``; ``w2 [E, H, I]``
    with ``w2_scale [E, ⌈H/128⌉, ⌈I/128⌉]``; scales are float32 dequantization multipliers.
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]

    @classmethod
    def quantize(cls, w13: torch.Tensor, w2: torch.Tensor, pow2: bool = False) -> Fp8Experts:
        """Quantize bf16/fp32 expert weights at load. Quantizing weights that were dequantized from an
        FP8 checkpoint with the same 128×128 tiles gives back the checkpoint's FP8 values (the tile
        amax is the scaled 448 again, and the bf16 rounding is far below e4m3's spacing), provided the
        gate/up split falls on a tile boundary (I % 128 == 0, true for every DeepSeek release).
        ``pow2``: power-of-two (UE8M0) scales, for SM100's DeepGEMM."""
        # One expert at a time: the float32 working copy of a whole layer would be tens of GB for V3.
        q13, s13 = zip(*(quantize_weight_blocks(w, pow2=pow2) for w in w13), strict=True)
        q2, s2 = zip(*(quantize_weight_blocks(w, pow2=pow2) for w in w2), strict=True)
        return cls(torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13, w2)`` as ``dtype`` tensors: the values every FP8 kernel is compared against."""
        return (dequantize_weight_blocks(self.w13, self.w13_scale, dtype=dtype),
                dequantize_weight_blocks(self.w2, self.w2_scale, dtype=dtype))
