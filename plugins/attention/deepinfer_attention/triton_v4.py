"""``triton_v4``: DeepSeek-V4 attention (ops ``sink_attention`` and ``indexer_topk``) on Triton, for
every row: decode, speculative verification and prefill chunks.

``sink_attention`` runs one ``v4_kernels.sink_attend`` launch over all the step's query tokens (one
program per token and head block): window keys of this step come from ``kv``, older ones from the ring,
then the compressed entries — the selected ones (CSA) or every complete one (HCA) — with the sinks;
only then are this step's keys written into the ring (each request's last ``size``, one
``index_copy_``), so no query reads a key its own step evicted and rows of any length are served.
``indexer_topk`` scores every entry of the block tables' width with ``v4_kernels.index_scores`` and keeps
the best ``topk`` with ``torch.topk`` (fixed k, −1 padding), in blocks of query rows whose float32
scores hold at most ``PREFILL_SCORE_ELEMENTS`` (the reference's bound), so a long prefill chunk never
materializes ``chunk × entries`` at once. Neither op falls back to the torch reference.

Host lists: a decode-only batch (``num_decodes`` = every request, or ``max_query_len == 1`` as a graph
replay states) maps tokens to requests by identity, other steps on the device from
``query_start_loc``; only the ring write of a step that does not state ``max_query_len`` within
``min(max_query_len, size)`` reads ``query_start_loc_host`` (to keep each request's last ``size`` keys:
prefill steps, never captured). Decode and verification steps can thus be captured in CUDA graphs.

``available()`` needs ``import triton`` and either CUDA or ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter, for the tests: slow, and only picked when named).
"""

from __future__ import annotations

import itertools

import torch

from deepinfer.interfaces import BackendCapabilities, ForwardContext
from deepinfer.ops import row_block
from deepinfer.testing import triton_interpreting
from deepinfer_attention.triton_backends import device_token_req, triton_usable

_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def all_decode(ctx: ForwardContext) -> bool:
    """Every request of the step brings one query token (host ints only; true in a graph replay)."""
    return ctx.max_query_len == 1 or ctx.num_decodes == ctx.block_tables.shape[0]


def ring_tokens(ctx: ForwardContext, size: int) -> torch.Tensor | None:
    """The query tokens whose keys a ring of ``size`` rows keeps: each request's last ``size`` (from
    the host lists), or None when that is every token."""
    spans = list(itertools.pairwise(ctx.query_start_loc_host))
    if all(hi - lo <= size for lo, hi in spans):
        return None
    return torch.tensor([t for lo, hi in spans for t in range(max(lo, hi - size), hi)], dtype=torch.int64,
                        device=ctx.positions.device)


def topk_entries(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` best columns of ``scores [n, width]`` (−inf: not a candidate), best first, int64
    ``[n, topk]`` with −1 for missing candidates. Shapes only: no host read."""
    k = min(topk, scores.shape[1])
    values, picks = scores.topk(k, dim=-1)
    picks = torch.where(values > float("-inf"), picks, -1)
    if k < topk:
        picks = torch.cat([picks, picks.new_full((scores.shape[0], topk - k), -1)], dim=1)
    return picks


class TritonV4Backend:
    """Ops ``sink_attention`` and ``indexer_topk`` with Triton kernels for every row (module docstring);
    steps stating at most ``max_query_len`` query tokens per request read no host list."""

    name = "triton_v4"
    ops = frozenset({"sink_attention", "indexer_topk", "indexer_scores"})

    def __init__(self, *, max_query_len: int = 16) -> None:
        self.max_query_len = max_query_len
        interpreting = triton_interpreting()
        # Above the reference (0) on CUDA, so ``kernels.attention: auto`` picks it; under the CPU
        # interpreter below it, so it runs only when named.
        self.priority = -1 if interpreting else 20
        self.capabilities = BackendCapabilities(
            devices=frozenset({"cuda", "cpu"}) if interpreting else frozenset({"cuda"}),
            dtypes=_DTYPES, graph_safe=True, batch_invariant=False, varlen=True)

    def available(self) -> bool:
        return triton_usable()

    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, ctx: ForwardContext, *,
                       window: int, scale: float, sinks: torch.Tensor, compressed: torch.Tensor | None = None,
                       ratio: int = 1, selected: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as ``TorchSinkAttentionBackend.sink_attention``; ``ring`` must be contiguous
        with at least ``window`` rows per slot (``window + max_backtrack`` in the engine)."""
        from deepinfer_attention.v4_kernels import sink_attend  # imports triton: only when this backend runs

        assert ctx.state_slots is not None, "sink_attention needs ctx.state_slots"
        size = ring.shape[1]
        token_req = None if all_decode(ctx) else device_token_req(ctx, q.shape[0])
        out = sink_attend(q, kv, ring, ctx.state_slots, ctx.positions, sinks, window=window, scale=scale,
                          token_req=token_req, query_starts=ctx.query_start_loc, floors=ctx.visibility_floor,
                          compressed=compressed, block_tables=ctx.block_tables, ratio=ratio, selected=selected)
        # Only now this step's keys go into the ring: all of them when no request can bring more than
        # ``size`` (no host read), else each request's last ``size`` (the reference's ring).
        host_free = all_decode(ctx) or 0 < ctx.max_query_len <= min(self.max_query_len, size)
        kept = None if host_free else ring_tokens(ctx, size)
        positions = ctx.positions
        if kept is not None:
            assert token_req is not None
            positions, token_req, kv = (x.index_select(0, kept) for x in (positions, token_req, kv))
        slots = ctx.state_slots if token_req is None else ctx.state_slots.index_select(0, token_req)
        ring.view(-1, ring.shape[-1]).index_copy_(0, slots * size + positions % size, kv)
        return out

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ctx: ForwardContext, *,
                     ratio: int, topk: int, scale: float) -> torch.Tensor:
        """Same contract as ``TorchSinkAttentionBackend.indexer_topk``: ``indexer_scores`` in blocks of query
        rows whose scores stay within ``PREFILL_SCORE_ELEMENTS``, each block's best ``topk`` kept."""
        tokens = q.shape[0]
        rows = row_block(ctx.block_tables.shape[1] * keys.shape[1])  # shapes only: graph-safe
        out = torch.empty(tokens, topk, dtype=torch.int64, device=q.device)
        for a in range(0, tokens, rows):
            b = min(tokens, a + rows)
            scores = self.indexer_scores(q[a:b], weights[a:b], keys, ctx, ratio=ratio, scale=scale, start=a)
            out[a:b] = topk_entries(scores, topk)
        return out

    def indexer_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ctx: ForwardContext, *,
                       ratio: int, scale: float, start: int = 0) -> torch.Tensor:
        """Same contract as ``TorchSinkAttentionBackend.indexer_scores`` (one ``index_scores`` launch; no host
        list for decode-only steps, so DeepSeek-V4.1's ranking of them captures in CUDA graphs)."""
        from deepinfer_attention.v4_kernels import index_scores  # imports triton: only when this backend runs

        rows = q.shape[0]
        if all_decode(ctx):  # token t is request t
            token_req = torch.arange(start, start + rows, device=q.device) if start else None
        else:
            token_req = device_token_req(ctx, start + rows)[start:]
        return index_scores(q, weights, keys, ctx.block_tables, ctx.positions[start:start + rows], ratio=ratio,
                            scale=scale, token_req=token_req)
