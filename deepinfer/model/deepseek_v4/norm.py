"""The RMSNorms of DeepSeek-V4: weighted with a float32 scale (``V4RMSNorm``) and unweighted."""

from __future__ import annotations

import torch
from torch import nn


class V4RMSNorm(nn.Module):
    """RMSNorm whose scale stays float32: normalize and scale in float32, cast once (as V4 does)."""

    def __init__(self, dim: int, eps: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last axis, the statistic in float32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
