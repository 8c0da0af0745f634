"""RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# torch's CUDA reduction (ATen Reduce.cuh, ReduceConfig::set_block_dimension) gives each row more threads,
# so another summation tree, when fewer than 16 rows are reduced; from 16 rows on, each row of width ≥ 32
# is reduced by one warp in an order fixed by its width. Padding to 16 rows keeps a row's statistics the
# same bits in any batch on CUDA (kernels.batch_invariant, reference/deepinfer.md §9).
BATCH_INVARIANT_CUDA_ROWS = 16


def mean_square(x32: torch.Tensor, min_cuda_rows: int = 1) -> torch.Tensor:
    """``mean(x32², -1, keepdim=True)``. A row's value does not depend on the number of rows on CPU
    (torch splits CPU reductions across rows only), nor on CUDA with ``min_cuda_rows`` =
    ``BATCH_INVARIANT_CUDA_ROWS`` (fewer rows are padded to that many)."""
    rows = x32.numel() // max(x32.shape[-1], 1)
    if not x32.is_cuda or rows >= min_cuda_rows:
        return x32.pow(2).mean(-1, keepdim=True)
    padded = F.pad(x32.reshape(rows, x32.shape[-1]), (0, 0, 0, min_cuda_rows - rows))
    return padded.pow(2).mean(-1, keepdim=True)[:rows].reshape(*x32.shape[:-1], 1)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistics in float32, the product cast back to the input dtype.
    ``min_cuda_rows``: see ``mean_square`` (the engine sets ``BATCH_INVARIANT_CUDA_ROWS`` under
    ``kernels.batch_invariant``; otherwise no padding work is done)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.min_cuda_rows = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if self.min_cuda_rows > 1:
            normed = x32 * torch.rsqrt(mean_square(x32, self.min_cuda_rows) + self.eps)
        elif x32.is_cuda:  # torch's fused kernel: one launch where the ops below are five (a CUDA graph's nodes)
            normed = F.rms_norm(x32, (x32.shape[-1],), eps=self.eps)
        else:  # the same values in three fewer ops than the batch-invariant form (a batch-1 CPU step, issue 36)
            normed = x32 * x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return self.weight * normed.to(x.dtype)


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
        x32 = x32 * torch.rsqrt(mean_square(x32, self.min_cuda_rows) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
