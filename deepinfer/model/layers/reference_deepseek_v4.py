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

Both ops run one request at a time and, within a request, in blocks of query rows (``row_block``): a
score tensor — ``[heads, rows, keys]`` logits, ``[rows, heads, entries]`` indexer scores, float32 — holds
at most ``PREFILL_SCORE_ELEMENTS`` elements, so a long prefill chunk never materializes
``chunk × (chunk + window + L/r) × heads`` at once (5.4 GB per copy for a 2,048-token chunk at 32k
positions of the V4-shaped model). A row is computed the same way whatever its block: on CPU the
results are bitwise those of one block (``tests/test_deepseek_v4_prefill_blocks.py``).
"""

from __future__ import annotations

import torch

from deepinfer.interfaces import BackendCapabilities, ForwardContext

_ALL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
# Float32 elements of one score tensor per block of query rows (512 MiB): the peak extra memory of a
# prefill chunk is a few such tensors, whatever the chunk and context lengths.
PREFILL_SCORE_ELEMENTS = 1 << 27


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


def row_block(per_row: int) -> int:
    """Query rows per block when each row's score tensor has ``per_row`` elements (at least one row)."""
    return max(1, PREFILL_SCORE_ELEMENTS // max(per_row, 1))


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
        out = torch.empty_like(q)
        starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
        dev = q.device
        for i, slot in enumerate(ctx.state_slots_host):
            lo, hi, end = starts[i], starts[i + 1], lens[i]
            n = hi - lo
            first = max(0, end - n - window + 1)
            keys = torch.cat([ring[slot].index_select(0, ring_rows(first, end - n, size, dev)), kv[lo:hi]])
            count = picks = None
            if compressed is not None:
                count = end // ratio
                keys = torch.cat([keys, gather_entries(compressed, ctx.block_tables[i], count)])
                if selected is not None:
                    picks = selected[lo:hi]
                    picks = torch.where(picks >= 0, picks, count)  # -1 -> a spill column, dropped below
            keep = min(n, size)
            ring[slot].index_copy_(0, ring_rows(end - keep, end, size, dev), kv[hi - keep:hi])
            floor = 0 if ctx.visibility_floor_host is None else ctx.visibility_floor_host[i]
            key_pos = torch.arange(first, end, device=dev)
            keys = keys.float()
            rows = row_block(q.shape[1] * (keys.shape[0] + 1))
            for a in range(0, n, rows):
                b = min(n, a + rows)
                q_pos = torch.arange(end - n + a, end - n + b, device=dev).unsqueeze(1)
                visible = self._visible(q_pos, key_pos, window, floor, count, ratio,
                                        None if picks is None else picks[a:b])
                out[lo + a:lo + b] = self._attend(q[lo + a:lo + b], keys, visible, scale, sinks)
        return out

    @staticmethod
    def _visible(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int, floor: int, count: int | None,
                 ratio: int, picks: torch.Tensor | None) -> torch.Tensor:
        """Mask ``[rows, keys]`` of the queries at ``q_pos [rows, 1]``: over the window keys at ``key_pos``,
        then (unless ``count`` is None) over ``count`` compressed entries — every complete one, or those in
        ``picks [rows, k]`` (the value ``count``: no entry)."""
        visible = (key_pos <= q_pos) & (key_pos > q_pos - window)
        if floor > 0:
            visible &= (key_pos >= floor) | (key_pos == q_pos)  # bounded replay
        if count is None:
            return visible
        if picks is None:
            seen = torch.arange(count, device=q_pos.device) < (q_pos + 1) // ratio
        else:
            seen = torch.zeros(q_pos.shape[0], count + 1, dtype=torch.bool, device=q_pos.device)
            seen = seen.scatter_(1, picks, True)[:, :count]
        return torch.cat([visible, seen], dim=1)

    @staticmethod
    def _attend(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float,
                sinks: torch.Tensor) -> torch.Tensor:
        """``q [rows, H, D]`` over float32 ``keys [L, D]`` (= values) where ``visible [rows, L]``, with one
        sink logit per head; float32 logits and softmax, the result in ``q``'s dtype."""
        heads, rows = q.shape[1], q.shape[0]
        logits = torch.einsum("nhd,ld->hnl", q.float(), keys).mul_(scale).masked_fill_(~visible, float("-inf"))
        sink = sinks.float().view(heads, 1, 1).expand(heads, rows, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hnl,ld->nhd", probs, keys).to(q.dtype)

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
            rows = row_block(q.shape[1] * count)
            for a in range(lo, hi, rows):
                b = min(hi, a + rows)
                scores = torch.einsum("nhd,cd->nhc", q[a:b].float(), entries).relu_().mul_(scale)
                scores = scores.mul_(weights[a:b].unsqueeze(-1)).sum(dim=1)  # [rows, count]
                complete = ((ctx.positions[a:b] + 1) // ratio).unsqueeze(1)
                scores = scores.masked_fill_(torch.arange(count, device=q.device) >= complete, float("-inf"))
                picks = scores.topk(min(topk, count), dim=-1).indices
                out[a:b, : picks.shape[1]] = torch.where(picks < complete, picks, -1)
        return out
