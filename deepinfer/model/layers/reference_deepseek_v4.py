"""Reference backend for DeepSeek-V4 attention in plain torch (ops ``sink_attention`` and
``indexer_topk``), and the helpers that address paged compressed entries (``kv/state.py``).

A V4 query at position p attends, with one shared key=value head (MQA, K = V), to
- the sliding window: the keys of positions ``(p − window, p]`` of its own request; this step's keys
  come in ``kv``, older ones from the layer's ring in the request's state slot (row ``pos % size``);
- compressed entries (CSA/HCA layers): entry ``e`` summarizes positions ``[e·r, (e+1)·r)`` and is
  visible once complete, ``e < (p + 1) // r``; a CSA layer further restricts the query to the entries
  its indexer selected (``selected``, −1 = no entry);
- a learned per-head sink: one extra logit per head that takes softmax mass and contributes no value.
Logits and softmax are computed in float32.

The lightning indexer of a CSA layer picks those entries (op ``indexer_topk``): entry ``e`` scores
``scale · Σ_h w_h · relu(q_h · k_e)`` for the query's indexer heads ``q_h`` and weights ``w_h``
(``reference/deepinfer.md`` §8), complete entries only; the query keeps its ``topk`` best.
"""

from __future__ import annotations

import torch

from deepinfer.interfaces import BackendCapabilities, ForwardContext

_ALL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def entry_rows(table: torch.Tensor, entries: torch.Tensor, per_block: int) -> torch.Tensor:
    """Flat rows of entries ``entries`` (int64 ``[n]``) of a request with block table row ``table``,
    in a ``[num_blocks, per_block, width]`` tensor viewed as ``[num_blocks · per_block, width]``."""
    return table[entries // per_block] * per_block + entries % per_block


def gather_entries(paged: torch.Tensor, table: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` compressed entries ``[count, width]`` of a request (block table ``table``)."""
    per_block, width = paged.shape[1], paged.shape[2]
    blocks = -(-count // per_block)
    return paged.index_select(0, table[:blocks]).reshape(-1, width)[:count]


def ring_rows(first: int, end: int, size: int, device: torch.device) -> torch.Tensor:
    """Ring rows of positions ``[first, end)`` in a ring of ``size`` rows."""
    return torch.arange(first, end, device=device) % size


class TorchSinkAttentionBackend:
    """Reference DeepSeek-V4 attention (ops ``sink_attention`` and ``indexer_topk``), one request at a time."""

    name = "torch_v4"
    priority = 0
    ops = frozenset({"sink_attention", "indexer_topk"})
    capabilities = BackendCapabilities(dtypes=_ALL_DTYPES, varlen=True)

    def available(self) -> bool:
        return True

    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, ctx: ForwardContext, *,
                       window: int, scale: float, sinks: torch.Tensor, compressed: torch.Tensor | None = None,
                       ratio: int = 1, selected: torch.Tensor | None = None) -> torch.Tensor:
        """``q [T, H, D]``, ``kv [T, D]`` this step's keys (= values, already rotated); ``ring
        [slots, size, D]`` the layer's sliding-window ring; ``sinks [H]``; ``compressed
        [num_blocks, block_size / ratio, D]`` the layer's paged compressed entries (this step's new
        entries already written) or None; ``selected [T, k]`` the entries each query may see (−1: none)
        or None (every complete entry). Reads the window's older keys from the ring, then writes this
        step's keys there (the last ``size`` positions of each request); window keys below
        ``ctx.visibility_floor_host`` are invisible but a query's own. Returns ``[T, H, D]``."""
        assert ctx.state_slots_host is not None, "sink_attention needs ctx.state_slots_host"
        size = ring.shape[1]
        heads = q.shape[1]
        out = torch.empty_like(q)
        starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
        dev = q.device
        for i, slot in enumerate(ctx.state_slots_host):
            lo, hi, end = starts[i], starts[i + 1], lens[i]
            n = hi - lo
            start = end - n
            first = max(0, start - window + 1)
            keys = torch.cat([ring[slot].index_select(0, ring_rows(first, start, size, dev)), kv[lo:hi]])
            key_pos = torch.arange(first, end, device=dev)
            q_pos = torch.arange(start, end, device=dev).unsqueeze(1)
            visible = (key_pos <= q_pos) & (key_pos > q_pos - window)
            if ctx.visibility_floor_host is not None and ctx.visibility_floor_host[i] > 0:
                visible &= (key_pos >= ctx.visibility_floor_host[i]) | (key_pos == q_pos)  # bounded replay
            if compressed is not None:
                count = end // ratio
                entries = gather_entries(compressed, ctx.block_tables[i], count)
                if selected is None:
                    seen = torch.arange(count, device=dev) < (q_pos + 1) // ratio
                else:
                    picks = selected[lo:hi]
                    picks = torch.where(picks >= 0, picks, count)  # -1 -> a spill column, dropped below
                    seen = torch.zeros(n, count + 1, dtype=torch.bool, device=dev).scatter_(1, picks, True)
                    seen = seen[:, :count]
                keys = torch.cat([keys, entries])
                visible = torch.cat([visible, seen], dim=1)
            keep = min(n, size)
            ring[slot].index_copy_(0, ring_rows(end - keep, end, size, dev), kv[hi - keep:hi])
            logits = torch.einsum("nhd,ld->hnl", q[lo:hi].float(), keys.float()) * scale
            logits = logits.masked_fill(~visible, float("-inf"))
            sink = sinks.float().view(heads, 1, 1).expand(heads, n, 1)
            probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
            out[lo:hi] = torch.einsum("hnl,ld->nhd", probs, keys.float()).to(q.dtype)
        return out

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ctx: ForwardContext, *,
                     ratio: int, topk: int, scale: float) -> torch.Tensor:
        """``q [T, heads, dim]`` the indexer queries (rotated), ``weights [T, heads]`` float32 the head
        weights, ``keys [num_blocks, block_size / ratio, dim]`` the layer's paged indexer keys (this
        step's new entries already written). Entry ``e`` scores ``scale · Σ_h weights_h · relu(q_h · k_e)``
        for a query at position p if complete, ``e < (p + 1) // ratio``. Returns int64 ``[T, topk]``:
        the best entries first, −1 where the query has fewer complete entries than ``topk``."""
        out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
        starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
        for i, end in enumerate(lens):
            lo, hi = starts[i], starts[i + 1]
            count = end // ratio
            if count == 0:
                continue
            entries = gather_entries(keys, ctx.block_tables[i], count).float()
            scores = torch.relu(torch.einsum("nhd,cd->nhc", q[lo:hi].float(), entries)) * scale
            scores = (scores * weights[lo:hi].unsqueeze(-1)).sum(dim=1)  # [n, count]
            complete = ((ctx.positions[lo:hi] + 1) // ratio).unsqueeze(1)
            scores = scores.masked_fill(torch.arange(count, device=q.device) >= complete, float("-inf"))
            picks = scores.topk(min(topk, count), dim=-1).indices
            out[lo:hi, : picks.shape[1]] = torch.where(picks < complete, picks, -1)
        return out
