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

Both ops run one request at a time and, within a request, in blocks of query rows, each block doing only
the work its rows need. ``sink_attention`` takes blocks of at most ``window`` rows; a block of positions
``[a, b)`` reads the band of window keys ``(a − window, b)`` (at most twice the keys a row sees: the ring
before the chunk, ``kv`` within it) and masks it per row; a CSA layer gathers each row's selected entries
``[rows, k, D]`` (−1 masked) and takes their logits row by row (``bmm``); an HCA layer takes the complete
entries ``[0, b // r)`` densely (a few: L/128), masked per row. One float32 softmax per row and head spans
[band ‖ entries ‖ sink]. ``indexer_topk`` scores each row against every entry of the request, masked to
the complete ones. Bounded memory: the score tensors — ``[rows, heads, band + entries + 1]`` logits,
``[rows, heads, entries]`` indexer scores — and the gathered ``[rows, k, D]`` entries, all float32, hold at
most ``PREFILL_SCORE_ELEMENTS`` elements (``band_rows``, ``row_block``), so a long prefill chunk never
materializes ``chunk × (chunk + window + L/r) × heads`` at once (5.4 GB per copy for a 2,048-token chunk
at 32k positions of the V4-shaped model). A row's attention depends on its block only through float32
rounding (its band may hold more masked keys); ``tests/test_deepseek_v4_prefill_blocks.py`` checks it
against a dense float64 statement of the semantics.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from deepinfer.interfaces import BackendCapabilities, ForwardContext
from deepinfer.kv import v41_cache

_ALL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
# Float32 elements of one score (or gathered-entry) tensor per block of query rows (512 MiB): the peak extra
# memory of a prefill chunk is a few such tensors, whatever the chunk and context lengths.
PREFILL_SCORE_ELEMENTS = 1 << 27


def entry_rows(table: torch.Tensor, entries: torch.Tensor, per_block: int) -> torch.Tensor:
    """Flat rows of entries ``entries`` (int64 ``[n]``) of a request with block table row ``table``,
    in a ``[num_blocks, per_block, width]`` tensor viewed as ``[num_blocks · per_block, width]``."""
    return table[entries // per_block] * per_block + entries % per_block


def gather_entries(paged: torch.Tensor, table: torch.Tensor, count: int, width: int | None = None) -> torch.Tensor:
    """The first ``count`` compressed entries ``[count, width]`` of a request (block table ``table``): in the
    cache's dtype, or dequantized to float32 when the cache holds one of V4.1's layouts (``kv/v41_cache.py``;
    then ``width``, the values a token, is required)."""
    per_block = paged.shape[1]
    blocks = paged.index_select(0, table[: -(-count // per_block)])
    if paged.dtype != torch.uint8:
        return blocks.reshape(-1, paged.shape[2])[:count]
    assert width is not None, "a quantized cache part needs its width"
    return v41_cache.read(blocks, width).reshape(-1, width)[:count]


def ring_rows(first: int, end: int, size: int, device: torch.device) -> torch.Tensor:
    """Ring rows of positions ``[first, end)`` in a ring of ``size`` rows."""
    return torch.arange(first, end, device=device) % size


def row_block(per_row: int) -> int:
    """Query rows per block when each row adds ``per_row`` elements to a block's tensor (at least one row)."""
    return max(1, PREFILL_SCORE_ELEMENTS // max(per_row, 1))


def band_rows(heads: int, width: int) -> int:
    """Query rows per block when a block of r rows has a ``[r, heads, r + width]`` score tensor (a window
    band that grows with the block, plus ``width`` more columns): the most r within the budget, at least 1."""
    budget = PREFILL_SCORE_ELEMENTS // max(heads, 1)
    return max(1, (math.isqrt(width * width + 4 * budget) - width) // 2)


class TorchSinkAttentionBackend:
    """Reference DeepSeek-V4 attention (ops ``sink_attention`` and ``indexer_topk``), one request at a time."""

    name = "torch_v4"
    priority = 0
    ops = frozenset({"sink_attention", "indexer_topk", "indexer_scores"})
    # cache.kv_dtype fp8 / fp4: V4.1's layouts (kv/v41_cache.py), dequantized to float32 on read.
    capabilities = BackendCapabilities(dtypes=_ALL_DTYPES, kv_dtypes=frozenset({"auto", "fp8", "fp4"}), varlen=True)

    def available(self) -> bool:
        return True

    def sink_attention(self, q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, ctx: ForwardContext, *,
                       window: int, scale: float, sinks: torch.Tensor, compressed: torch.Tensor | None = None,
                       ratio: int = 1, selected: torch.Tensor | None = None) -> torch.Tensor:
        """``q [T, H, D]``, ``kv [T, D]`` this step's keys (= values, already rotated); ``ring
        [slots, size, D]`` the layer's sliding-window ring; ``sinks [H]``; ``compressed
        [num_blocks, block_size / ratio, D]`` the layer's paged compressed entries (this step's new
        entries already written) or None; ``selected [T, k]`` the distinct entries each query may see
        (−1: none) or None (every complete entry). Reads the window's older keys from the ring, then writes
        this step's keys there (the last ``size`` positions of each request); window keys below
        ``ctx.visibility_floor_host`` are invisible but a query's own. Returns ``[T, H, D]``. ``ring`` and
        ``compressed`` may hold V4.1's layouts (``kv/v41_cache.py``): reads dequantize, ring writes quantize,
        and this step's window keys are attended as they read back from the ring."""
        assert ctx.state_slots_host is not None, "sink_attention needs ctx.state_slots_host"
        size, heads, width = ring.shape[1], q.shape[1], kv.shape[-1]
        seen = v41_cache.roundtrip(kv, v41_cache.format_of(ring, width))
        out = torch.empty_like(q)
        starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
        dev = q.device
        for i, slot in enumerate(ctx.state_slots_host):
            lo, hi, end = starts[i], starts[i + 1], lens[i]
            n = hi - lo
            first = max(0, end - n - window + 1)  # the oldest window key of the chunk's first query
            older = v41_cache.read(ring[slot].index_select(0, ring_rows(first, end - n, size, dev)), width)
            keys = torch.cat([older, seen[lo:hi].float()])
            entries = picks = None
            extra = 0  # score columns of a row besides its band and sink
            if compressed is not None and end // ratio > 0:
                entries = gather_entries(compressed, ctx.block_tables[i], end // ratio, width).float()
                if selected is None:
                    extra = entries.shape[0]
                else:
                    picks = selected[lo:hi]
                    extra = picks.shape[1]
            # Blocks of at most a window of rows: a block's band then holds at most twice the keys a row sees.
            rows = min(window, band_rows(heads, window + extra))
            if picks is not None:
                rows = min(rows, row_block(picks.shape[1] * entries.shape[1]))  # the gathered [rows, k, D]
            keep = min(n, size)
            v41_cache.write(ring[slot], ring_rows(end - keep, end, size, dev), kv[hi - keep:hi])
            floor = 0 if ctx.visibility_floor_host is None else ctx.visibility_floor_host[i]
            for a in range(0, n, rows):
                b = min(n, a + rows)
                out[lo + a:lo + b] = self._attend_block(
                    q[lo + a:lo + b], keys, first, end - n + a, window=window, floor=floor, scale=scale,
                    sinks=sinks, entries=entries, ratio=ratio, picks=None if picks is None else picks[a:b])
        return out

    @staticmethod
    def _attend_block(q: torch.Tensor, keys: torch.Tensor, first: int, start: int, *, window: int, floor: int,
                      scale: float, sinks: torch.Tensor, entries: torch.Tensor | None, ratio: int,
                      picks: torch.Tensor | None) -> torch.Tensor:
        """Attention of the queries ``q [rows, H, D]`` at positions ``[start, start + rows)`` of one request,
        whose float32 window keys ``keys [L, D]`` hold positions ``first, first + 1, …``: only the band
        ``(start − window, start + rows)`` is read. ``entries [count, D]`` float32 are the request's
        compressed entries, or None: with ``picks [rows, k]`` (−1: none) each row sees the entries it
        names, gathered per row; without, each row sees every complete entry, ``e < (p + 1) // ratio``.
        One float32 softmax per row and head over [band ‖ entries ‖ sink]; the result in ``q``'s dtype."""
        rows, heads = q.shape[0], q.shape[1]
        end = start + rows
        low = max(first, start - window + 1)
        band = keys[low - first:end - first]  # positions [low, end)
        q_pos = torch.arange(start, end, device=q.device).unsqueeze(1)
        key_pos = torch.arange(low, end, device=q.device)
        visible = (key_pos <= q_pos) & (key_pos > q_pos - window)
        if floor > 0:
            visible &= (key_pos >= floor) | (key_pos == q_pos)  # bounded replay
        qf = q.float() * scale
        parts = [torch.einsum("nhd,ld->nhl", qf, band).masked_fill_(~visible.unsqueeze(1), float("-inf"))]
        seen = None
        if entries is not None:
            if picks is None:
                seen = entries[: end // ratio]  # complete for the block's last row
                hidden = torch.arange(seen.shape[0], device=q.device) >= (q_pos + 1) // ratio
                parts.append(torch.einsum("nhd,ed->nhe", qf, seen).masked_fill_(hidden.unsqueeze(1), float("-inf")))
            else:
                seen = entries[picks.clamp(min=0)]  # [rows, k, D]
                parts.append(torch.bmm(qf, seen.transpose(1, 2)).masked_fill_((picks < 0).unsqueeze(1),
                                                                               float("-inf")))
        parts.append(sinks.float().view(1, heads, 1).expand(rows, heads, 1))
        probs = torch.cat(parts, dim=-1).softmax(dim=-1)
        res = torch.einsum("nhl,ld->nhd", probs[..., :band.shape[0]], band)
        if seen is not None:
            weights = probs[..., band.shape[0]:-1]
            res += torch.bmm(weights, seen) if picks is not None else torch.einsum("nhe,ed->nhd", weights, seen)
        return res.to(q.dtype)

    def indexer_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ctx: ForwardContext, *,
                     ratio: int, topk: int, scale: float) -> torch.Tensor:
        """``q [T, heads, dim]`` the indexer queries (rotated), ``weights [T, heads]`` float32 the head
        weights, ``keys [num_blocks, block_size / ratio, dim]`` the layer's paged indexer keys (this
        step's new entries already written). Entry ``e`` scores ``scale · Σ_h weights_h · relu(q_h · k_e)``
        for a query at position p if complete, ``e < (p + 1) // ratio``. Returns int64 ``[T, topk]``:
        the best entries first, −1 where the query has fewer complete entries than ``topk``."""
        out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
        for i, lo, hi, count in _request_rows(ctx, 0, q.shape[0], ratio):
            for a, b, scores in _request_scores(q, weights, keys, ctx, i, lo, hi, count, ratio, scale):
                picks = scores.topk(min(topk, count), dim=-1)
                out[a:b, : picks.indices.shape[1]] = torch.where(picks.values > float("-inf"), picks.indices, -1)
        return out

    def indexer_scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ctx: ForwardContext, *,
                       ratio: int, scale: float, start: int = 0) -> torch.Tensor:
        """The scores ``indexer_topk`` ranks, for the step's query rows ``[start, start + len(q))`` (``q`` and
        ``weights`` hold those rows): float32 ``[rows, block_tables.shape[1] · keys.shape[1]]`` — every
        entry a block table can address — with −inf for incomplete entries and past each request's
        entries (DeepSeek-V4.1 ranks them itself: candidate blocks, ``v41_indexer.py``)."""
        width = ctx.block_tables.shape[1] * keys.shape[1]
        out = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float32, device=q.device)
        for i, lo, hi, count in _request_rows(ctx, start, start + q.shape[0], ratio):
            for a, b, scores in _request_scores(q, weights, keys, ctx, i, lo, hi, count, ratio, scale, start):
                out[a:b, :count] = scores
        return out


def _request_rows(ctx: ForwardContext, start: int, end: int, ratio: int) -> Iterator[tuple[int, int, int, int]]:
    """``(request, lo, hi, entries)`` of each request with query rows in ``[start, end)`` and at least one
    entry: its rows there (step indices) and its entry count after this step (host lists)."""
    starts = ctx.query_start_loc_host
    for i, length in enumerate(ctx.seq_lens_host):
        lo, hi, count = max(starts[i], start), min(starts[i + 1], end), length // ratio
        if lo < hi and count:
            yield i, lo, hi, count


def _request_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ctx: ForwardContext, i: int,
                    lo: int, hi: int, count: int, ratio: int, scale: float,
                    start: int = 0) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Request ``i``'s float32 index scores ``[rows, count]`` (−inf for incomplete entries) of step rows
    ``[lo, hi)`` (``q``/``weights`` row ``t − start``), in blocks of rows ``(a, b, scores)`` (indices into
    ``q``) that bound the ``[rows, heads, count]`` product (the reference's ``PREFILL_SCORE_ELEMENTS``)."""
    entries = gather_entries(keys, ctx.block_tables[i], count, q.shape[-1]).float()
    visible, step = torch.arange(count, device=q.device), row_block(q.shape[1] * count)
    for a in range(lo - start, hi - start, step):
        b = min(hi - start, a + step)
        scores = torch.einsum("nhd,cd->nhc", q[a:b].float(), entries).relu_().mul_(scale)
        scores = scores.mul_(weights[a:b].unsqueeze(-1)).sum(dim=1)
        complete = ((ctx.positions[a + start:b + start] + 1) // ratio).unsqueeze(1)
        yield a, b, scores.masked_fill_(visible >= complete, float("-inf"))
