"""RMSNorm."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistics in float32, the product cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, all of it in float32 and cast back once at the
    end (Gemma checkpoints store the scale minus one, and HF multiplies before the cast, unlike Llama)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__(dim, eps, dtype=dtype, device=device)
        with torch.no_grad():
            self.weight.zero_()  # scale 1: the identity until weights are loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
