"""DeepSeek-V4.1's projected indexer and the candidate-block limit.

V4.1 has no indexer compressor: a KV-source layer's indexer key of entry ``e`` is
``rope(k_norm(wk(c_e)))`` where ``c_e`` is the normed compressed entry before its rope, at the entry's
position ``e · ratio`` (reference/deepinfer.md §8). Queries come from ``q_a_norm``'s output
(``wq_b``, rope), head weights from the layer input (``weights_proj / sqrt(heads)``), and entry ``e``
scores ``index_head_dim**-0.5 · Σ_h w_h · relu(q_h · k_e)`` for a query at position p if complete,
``e < (p + 1) // ratio``.

Candidate blocks (reference ``candidate_blocks.py``, ``index_attn.py``): the candidate source layer
groups its entries in blocks of ``candidate_block_size``, scores a block by its best entry, always
keeps the block of its last complete entry (score +inf) and picks ``candidate_topk_blocks`` blocks per
query (−1: none). The index sources after it score only entries whose block (of ``block_tokens / ratio``
of their own entries) was picked; the source's own top-k is unrestricted.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.model.deepseek_v4.config import V4Dims
from deepinfer.model.deepseek_v4.norm import V4RMSNorm
from deepinfer.model.deepseek_v4.rotary import V4Rotary
from deepinfer.model.deepseek_v4.v41_config import CandidateLimit
from deepinfer.model.layers.reference_deepseek_v4 import row_block


class IndexKeys(nn.Module):
    """``wk`` and ``k_norm``: the indexer keys of a KV-source layer's entries."""

    def __init__(self, d: V4Dims, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.wk_weight = nn.Parameter(torch.empty(d.index_dim, d.head_dim, dtype=dtype, device=device))
        self.k_norm = V4RMSNorm(d.index_dim, d.eps, device=device)
        self.rotary: V4Rotary | None = None  # the layer's (compress) rope, set by the attention

    def forward(self, normed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys ``[n, index_dim]`` of normed, not yet roped entries ``[n, head_dim]`` at ``positions [n]``."""
        assert self.rotary is not None
        keys = self.k_norm(torch.nn.functional.linear(normed, self.wk_weight))
        return self.rotary.rotate(keys, positions)


class IndexQuery(nn.Module):
    """``wq_b`` and ``weights_proj``: an index source's queries and head weights."""

    def __init__(self, d: V4Dims, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.heads, self.dim = d.index_heads, d.index_dim
        self.q_b_weight = nn.Parameter(torch.empty(d.index_heads * d.index_dim, d.q_lora, dtype=dtype, device=device))
        self.weights_weight = nn.Parameter(torch.empty(d.index_heads, d.hidden, dtype=dtype, device=device))

    def forward(self, q_latent: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                rotary: V4Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries ``[T, heads, dim]`` and float32 head weights ``[T, heads]``."""
        gemm = ctx.backends["linear"]
        q = rotary.rotate(gemm.linear(q_latent, self.q_b_weight).view(-1, self.heads, self.dim), positions)
        return q, gemm.linear(x, self.weights_weight).float() * self.heads ** -0.5


def top_entries(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The best ``topk`` entries ``[rows, topk]`` int64 of ``scores``, −1 where fewer are above −inf."""
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int64, device=scores.device)
    if scores.shape[1] == 0:
        return out
    best = scores.topk(min(topk, scores.shape[1]), dim=-1)
    out[:, : best.indices.shape[1]] = torch.where(best.values > float("-inf"), best.indices, -1)
    return out


def candidate_blocks(scores: torch.Tensor, limit: CandidateLimit) -> torch.Tensor:
    """The candidate source's picks ``[rows, topk_blocks]`` (−1: none): blocks of ``limit.block_size``
    entries scored by their best entry, the block of the last complete entry forced first."""
    rows, count = scores.shape
    if count == 0:  # no entry yet (a request shorter than the ratio): no block
        return torch.full((rows, limit.topk_blocks), -1, dtype=torch.int64, device=scores.device)
    size = limit.block_size
    nblocks = -(-count // size)
    padded = scores.new_full((rows, nblocks * size), float("-inf"))
    padded[:, :count] = scores
    block = padded.view(rows, nblocks, size).amax(dim=-1)
    complete = (scores > float("-inf")).sum(dim=1)  # complete entries are a prefix
    valid = -(-complete // size)
    last = (valid - 1).clamp(min=0).unsqueeze(1)
    block.scatter_(1, last, torch.where(valid.unsqueeze(1) > 0, float("inf"), block.gather(1, last)))
    return top_entries(block, limit.topk_blocks)


def restrict_to_candidates(scores: torch.Tensor, picks: torch.Tensor, entries_per_block: int) -> torch.Tensor:
    """``scores [rows, count]`` with every entry outside the picked blocks ``picks [rows, k]`` at −inf."""
    block_of = torch.arange(scores.shape[1], device=scores.device) // entries_per_block
    inside = (block_of.view(1, 1, -1) == picks.unsqueeze(-1)).any(dim=1)
    return scores.masked_fill(~inside, float("-inf"))


def select(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ctx: ForwardContext, *, ratio: int,
           topk: int, scale: float, limit: CandidateLimit | None, role: str,
           candidates: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An index source's top-k ``[T, topk]`` (−1: none). ``role``: ``"plain"``, ``"source"`` (also returns
    the candidate blocks ``[T, topk_blocks]``) or ``"limited"`` (scores only inside ``candidates``). The
    scores come from the backend op ``indexer_scores`` over every entry the block tables
    address, in blocks of query rows that bound them; the ranking here reads no host list, so with a
    graph-safe backend a decode step captures."""
    backend = ctx.backends["indexer_scores"]
    tokens = q.shape[0]
    out = torch.empty(tokens, topk, dtype=torch.int64, device=q.device)
    picked = (None if role != "source" or limit is None
              else torch.empty(tokens, limit.topk_blocks, dtype=torch.int64, device=q.device))
    step = row_block(ctx.block_tables.shape[1] * keys.shape[1])
    for lo in range(0, tokens, step):
        hi = min(tokens, lo + step)
        scores = backend.indexer_scores(q[lo:hi], weights[lo:hi], keys, ctx, ratio=ratio, scale=scale, start=lo)
        if picked is not None and limit is not None:
            picked[lo:hi] = candidate_blocks(scores, limit)
        if role == "limited":
            assert candidates is not None and limit is not None
            scores = restrict_to_candidates(scores, candidates[lo:hi], limit.block_tokens // ratio)
        out[lo:hi] = top_entries(scores, topk)
    return out, picked
