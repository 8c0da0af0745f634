"""``triton_v4``: DeepSeek-V4 attention (ops ``sink_attention`` and ``indexer_topk``) on Triton.

Short rows — requests with at most ``max_query_len`` query tokens (decode, speculative verification),
and for ``sink_attention`` at most ``size − window + 1`` (so a request's new keys never evict a key
that one of its queries still sees) — run on the device: this step's keys go into the ring with one
``index_copy_``, then ``v4_kernels.sink_decode`` attends over the sliding window and the selected (or,
for HCA layers, all complete) compressed entries with the sinks; the indexer scores every entry of
the block tables' width with ``v4_kernels.index_scores`` and keeps the best ``topk`` with
``torch.topk`` (fixed k, −1 padding). A decode-only batch (``num_decodes`` = every request, or
``max_query_len == 1`` as a graph replay states) reads no host list and its shapes come from tensor
shapes, so it can be captured in a CUDA graph. Longer rows (prefill chunks) take the reference path
(``TorchSinkAttentionBackend``) on a context cut to those requests (``plan_rows``/``sub_context`` of
``triton_backends.py``, shared with the GQA and MLA backends).

``available()`` needs ``import triton`` and either CUDA or ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter, for the tests: slow, and only picked when named).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from deepinfer.interfaces import BackendCapabilities, ForwardContext
from deepinfer.model.layers.reference_deepseek_v4 import TorchSinkAttentionBackend
from deepinfer_attention.triton_backends import plan_rows, sub_context, triton_usable

_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def all_decode(ctx: ForwardContext) -> bool:
    """Every request of the step brings one query token (host ints only; true in a graph replay)."""
    return ctx.max_query_len == 1 or ctx.num_decodes == ctx.block_tables.shape[0]


def long_context(ctx: ForwardContext, requests: tuple[int, ...], tokens: torch.Tensor) -> ForwardContext:
    """``sub_context`` (requests ``requests``, query tokens ``tokens``) with the requests' visibility
    floors too (bounded replay), which the reference's window reads per request."""
    sub = sub_context(ctx, requests, tokens)
    if ctx.visibility_floor_host is None:
        return sub
    rows = torch.tensor(requests, dtype=torch.int64, device=ctx.positions.device)
    return dataclasses.replace(
        sub, visibility_floor_host=[ctx.visibility_floor_host[i] for i in requests],
        visibility_floor=None if ctx.visibility_floor is None else ctx.visibility_floor.index_select(0, rows))


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
    """Ops ``sink_attention`` and ``indexer_topk`` with Triton kernels for rows of at most
    ``max_query_len`` query tokens (module docstring)."""

    name = "triton_v4"
    ops = frozenset({"sink_attention", "indexer_topk"})

    def __init__(self, *, max_query_len: int = 16) -> None:
        self.max_query_len = max_query_len
        interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
        # Above the reference (0) on CUDA, so ``kernels.attention: auto`` picks it; under the CPU
        # interpreter below it, so it runs only when named.
        self.priority = -1 if interpreting else 20
        self.capabilities = BackendCapabilities(
            devices=frozenset({"cuda", "cpu"}) if interpreting else frozenset({"cuda"}),
            dtypes=_DTYPES, graph_safe=True, batch_invariant=False, varlen=True)
        self.reference = TorchSinkAttentionBackend()

    def available(self) -> bool:
        return triton_usable()

    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, ctx: ForwardContext, *,
                       window: int, scale: float, sinks: torch.Tensor, compressed: torch.Tensor | None = None,
                       ratio: int = 1, selected: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as ``TorchSinkAttentionBackend.sink_attention``; ``ring`` must be contiguous
        with at least ``window`` rows per slot (``window + max_backtrack`` in the engine)."""
        from deepinfer_attention.v4_kernels import sink_decode  # imports triton: only when this backend runs

        assert ctx.state_slots is not None, "sink_attention needs ctx.state_slots"
        size = ring.shape[1]
        kw = {"window": window, "scale": scale, "compressed": compressed, "block_tables": ctx.block_tables,
              "ratio": ratio}

        def short(rows: torch.Tensor | None, token_req: torch.Tensor | None) -> torch.Tensor:
            """Write the keys of tokens ``rows`` (None: all) into the ring, then one kernel launch."""
            pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
            positions = pick(ctx.positions)
            slots = ctx.state_slots if token_req is None else ctx.state_slots.index_select(0, token_req)
            # Writing before reading is safe: a request writes at most size − window + 1 rows, all
            # outside the window of its earliest query.
            ring.view(-1, ring.shape[-1]).index_copy_(0, slots * size + positions % size, pick(kv))
            return sink_decode(pick(q), ring, ctx.state_slots, positions, sinks, token_req=token_req,
                               floors=ctx.visibility_floor, selected=None if selected is None else pick(selected),
                               **kw)

        if all_decode(ctx):
            return short(None, None)
        plan = plan_rows(ctx, q.shape[0], min(self.max_query_len, size - window + 1))
        if plan.long_tokens is None:
            return short(None, plan.token_req)
        assert plan.kernel_tokens is not None
        out = torch.empty_like(q)
        if plan.kernel_tokens.numel():
            out.index_copy_(0, plan.kernel_tokens, short(plan.kernel_tokens, plan.token_req))
        lt = plan.long_tokens
        out.index_copy_(0, lt, self.reference.sink_attention(
            q.index_select(0, lt), kv.index_select(0, lt), ring, long_context(ctx, plan.long_requests, lt),
            window=window, scale=scale, sinks=sinks, compressed=compressed, ratio=ratio,
            selected=None if selected is None else selected.index_select(0, lt)))
        return out

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ctx: ForwardContext, *,
                     ratio: int, topk: int, scale: float) -> torch.Tensor:
        """Same contract as ``TorchSinkAttentionBackend.indexer_topk``."""
        from deepinfer_attention.v4_kernels import index_scores  # imports triton: only when this backend runs

        def short(rows: torch.Tensor | None, token_req: torch.Tensor | None) -> torch.Tensor:
            pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
            scores = index_scores(pick(q), pick(weights), keys, ctx.block_tables, pick(ctx.positions), ratio=ratio,
                                  scale=scale, token_req=token_req)
            return topk_entries(scores, topk)

        if all_decode(ctx):
            return short(None, None)
        plan = plan_rows(ctx, q.shape[0], self.max_query_len)
        if plan.long_tokens is None:
            return short(None, plan.token_req)
        assert plan.kernel_tokens is not None
        out = torch.empty(q.shape[0], topk, dtype=torch.int64, device=q.device)
        if plan.kernel_tokens.numel():
            out.index_copy_(0, plan.kernel_tokens, short(plan.kernel_tokens, plan.token_req))
        lt = plan.long_tokens
        out.index_copy_(0, lt, self.reference.indexer_topk(
            q.index_select(0, lt), weights.index_select(0, lt), keys, long_context(ctx, plan.long_requests, lt),
            ratio=ratio, topk=topk, scale=scale))
        return out
