"""DeepSeek-V4's residual: mHC hyper-connections.

The residual is ``hc_mult`` streams ``[T, m, H]`` (the embedding copied m times). Around each sub-layer
(attention, then MoE) a hyper-connection reads the RMS-normalized flattened streams through one
projection ``fn [(2+m)·m, m·H]`` (times ``scale``, plus ``base``) and yields ``pre = sigmoid(·) + eps``
(mixes the streams into the sub-layer input), ``post = 2·sigmoid(·)`` (spreads the output back) and
``comb = softmax(·) + eps`` made doubly stochastic by Sinkhorn (column normalization, then
``hc_sinkhorn_iters − 1`` row/column rounds). New streams: ``out[k] = post[k]·y + Σ_j comb[j, k]·streams[j]``.
The final ``hc_head`` folds the streams with its own ``pre`` weights before the last RMSNorm. DeepSeek-V4.1's
``hc_shifted`` collapses each sub-layer's streams with the ``pre`` of the sub-layer before (``mixes``,
``collapse``; ``v41.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.model.deepseek_v4.config import V4Dims
from deepinfer.model.deepseek_v4.norm import unweighted_rms_norm


class HyperConnection(nn.Module):
    """One mHC site: from the streams, the sub-layer input and the (post, comb) weights of the write-back."""

    def __init__(self, d: V4Dims, device: torch.device | None = None) -> None:
        super().__init__()
        m = d.hc_mult
        self.m, self.iters, self.hc_eps, self.norm_eps = m, d.hc_iters, d.hc_eps, d.eps
        kw = {"dtype": torch.float32, "device": device}
        self.fn = nn.Parameter(torch.empty((2 + m) * m, m * d.hidden, **kw))
        self.base = nn.Parameter(torch.empty((2 + m) * m, **kw))
        self.scale = nn.Parameter(torch.empty(3, **kw))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, m, H]`` → ``post [T, m]``, ``comb [T, m, m]`` (float32), ``collapsed [T, H]``."""
        pre, post, comb = self.mixes(streams)
        return post, comb, self.collapse(pre, streams)

    def mixes(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, m, H]`` → float32 ``pre [T, m]``, ``post [T, m]`` and Sinkhorn ``comb [T, m, m]``."""
        m = self.m
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mixes.split([m, m, m * m], dim=-1)
        pre_b, post_b, comb_b = self.base.split([m, m, m * m])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = (comb_w * self.scale[2] + comb_b).view(-1, m, m).softmax(dim=-1) + self.hc_eps
        if torch.compiler.is_compiling():
            return pre, post, sinkhorn_cells(comb, self.iters, self.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)  # Sinkhorn: columns, then rounds
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    @staticmethod
    def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The sub-layer input ``Σ_k pre[k]·streams[k]`` ``[T, H]`` (in the streams' dtype)."""
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    @staticmethod
    def write_back(post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """``out[k] = post[k]·y + Σ_j comb[j, k]·streams[j]`` (comb is applied transposed)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * y.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(1, 2), streams)


def sinkhorn_cells(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``HyperConnection.mixes``' Sinkhorn rounds on ``comb [T, m, m]`` written cell by cell: every op is
    elementwise over the token dimension, so Inductor fuses all the rounds into a few kernels (the tensor
    form's row and column sums each end a kernel on CUDA: ~39 launches per site at 20 iterations). For
    compiled layers; the tensor form stays the reference (equal up to the order of 4-term sums)."""
    m = comb.shape[-1]
    cells = [[comb[:, i, j] for j in range(m)] for i in range(m)]

    def columns(c: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        sums = [sum(c[i][j] for i in range(m)) + eps for j in range(m)]
        return [[c[i][j] / sums[j] for j in range(m)] for i in range(m)]

    def rows(c: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        sums = [sum(c[i]) + eps for i in range(m)]
        return [[c[i][j] / sums[i] for j in range(m)] for i in range(m)]

    cells = columns(cells)
    for _ in range(iters - 1):
        cells = columns(rows(cells))
    return torch.stack([torch.stack(row, dim=-1) for row in cells], dim=1)


class HyperHead(nn.Module):
    """The final fold of the streams into one hidden state."""

    def __init__(self, d: V4Dims, device: torch.device | None = None) -> None:
        super().__init__()
        m = d.hc_mult
        self.hc_eps, self.norm_eps = d.hc_eps, d.eps
        kw = {"dtype": torch.float32, "device": device}
        self.fn = nn.Parameter(torch.empty(m, m * d.hidden, **kw))
        self.base = nn.Parameter(torch.empty(m, **kw))
        self.scale = nn.Parameter(torch.empty(1, **kw))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn) * self.scale + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
