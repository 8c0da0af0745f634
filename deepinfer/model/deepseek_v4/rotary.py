"""DeepSeek-V4's rope: interleaved pairs on the trailing ``rope_dim`` channels (``V4Rotary``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepinfer.model.layers.rope import inverse_frequencies


class V4Rotary(nn.Module):
    """cos/sin tables ``[positions, rope/2]`` of one rope set, applied to the trailing ``rope_dim``
    channels as interleaved pairs ``(x0, x1), (x2, x3), …`` rotated in place."""

    def __init__(self, params: dict[str, Any], rope_dim: int, max_positions: int,
                 device: torch.device | None = None) -> None:
        super().__init__()
        inv_freq, factor = inverse_frequencies(params, rope_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.rope_dim = rope_dim
        self.register_buffer("cos", (freqs.cos() * factor).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * factor).to(device), persistent=False)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``x [T, ..., D]`` rotated by the angle of ``positions [T]`` (backwards with ``inverse``)."""
        shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (self.cos.shape[1],)
        cos, sin = self.cos[positions].view(shape), self.sin[positions].view(shape)
        if inverse:
            sin = -sin
        nope, rope = x[..., : -self.rope_dim], x[..., -self.rope_dim:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
        return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
