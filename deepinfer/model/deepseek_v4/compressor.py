"""DeepSeek-V4's compressors and lightning indexer.

- **HCA** (heavily compressed): a compressor pools each non-overlapping window of ``r`` tokens into one
  entry ``norm(Σ_j softmax_j(gate_j + bias_j) ⊙ kv_j)`` (softmax over the window per channel), roped
  at the window's first position; a query sees every complete entry.
- **CSA** (compressed sparse): the compressor projects to two series (Ca = first ``head_dim``
  channels, Cb = the rest); entry ``w`` pools window ``w − 1``'s Ca with window ``w``'s Cb (2r slots,
  entry 0 has no Ca). A lightning indexer (its own CSA-style compressor at ``index_head_dim``, its
  own query projection from ``q_a_norm``'s output) scores entries as ``Σ_h w_h · relu(q_h · k)``
  (``w = weights_proj(x) / sqrt(heads)``, times ``index_head_dim**-0.5``); each query sees its top
  ``index_topk`` complete entries.

Cache (``kv/state.py``): per layer one ``HybridLayerSpec``. Paged: compressed entries (and the
indexer's keys), ``block_size / r`` per block. State slot rings: the sliding keys
(``window + max_backtrack`` rows) and the compressors' raw per-token projections (kv and gate,
``2r + max_backtrack`` rows for CSA, ``r + max_backtrack`` for HCA), all indexed by position, so a
rollback of at most ``max_backtrack`` tokens is just the request's length going back: nothing is
undone, the entries and ring rows of recomputed positions are rewritten. An entry is computed in the
step that computes its window's last token, from the ring (older positions) and the step's rows.
Rows below ``ctx.write_floor_host`` (exact replay after a prefix hit) do not write paged entries.
Steps of at most ``max_backtrack + 1`` query tokens per request (decode and speculative verification
steps, ``device_rows``) update the compressors on device tensors only (``Compressor._update_rows``,
bitwise equal to the per-request path), so CUDA graphs capture them; other steps (prefill chunks,
exact replay, YoCo truncation) go request by request on the host lists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.kv import v41_cache
from deepinfer.kv.row_writes import write_rows
from deepinfer.model.deepseek_v4.config import V4Dims
from deepinfer.model.deepseek_v4.norm import V4RMSNorm
from deepinfer.model.deepseek_v4.rotary import V4Rotary
from deepinfer.model.deepseek_v4.rows import StepRows, _DeviceRows
from deepinfer.model.layers.reference_deepseek_v4 import entry_rows, ring_rows


class Compressor(nn.Module):
    """Pools ``ratio`` tokens into one entry of ``width`` (HCA: one series; CSA and the indexer:
    ``overlap``, two series over 2·ratio slots). Bound to a paged entry tensor and a ring of the raw
    per-token ``[kv, gate]`` projections (``bind``)."""

    def __init__(self, d: V4Dims, width: int, ratio: int, overlap: bool, dtype: torch.dtype,
                 device: torch.device | None = None, ape: bool = True, gated: bool = True) -> None:
        super().__init__()
        if not gated and ratio != 1:
            raise ValueError(f"an ungated compressor pools one token per entry, not {ratio}")
        self.width, self.ratio, self.overlap, self.gated = width, ratio, overlap, gated
        self.series = (2 if overlap else 1) * width
        rows = (2 if gated else 1) * self.series
        self.kv_gate_weight = nn.Parameter(torch.empty(rows, d.hidden, dtype=dtype, device=device))
        if ape:
            self.position_bias = nn.Parameter(torch.empty(ratio, self.series, dtype=torch.float32, device=device))
        else:  # V4.1: no position bias (the gate alone weighs the window's tokens)
            self.register_buffer("position_bias", torch.zeros(ratio, self.series, dtype=torch.float32, device=device),
                                 persistent=False)
        self.norm = V4RMSNorm(width, d.eps, device=device)
        self.paged: torch.Tensor | None = None
        self.ring: torch.Tensor | None = None
        # V4.1 (``v41_indexer.IndexKeys``): each writer's indexer keys of every new entry, from its normed,
        # unroped value, written to the writer's paged tensor at the entry's row (the KV source's own keys,
        # then those of index-K sources that read this layer's entries). Not submodules: each key projection
        # belongs to its own layer.
        self.index_writers: list[tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor]] = []

    def ring_span(self) -> int:
        """Positions an entry reads back: its window, and the previous one with overlap."""
        return (2 if self.overlap else 1) * self.ratio

    def update(self, x: torch.Tensor, ctx: ForwardContext, step_rows: StepRows, rotary: V4Rotary) -> None:
        """Project this step's rows of ``x [T, H]``, write every entry whose window closes in this step
        (unless below the request's write floor) and keep the projections in the ring: on device tensors
        only when ``step_rows`` are ``_DeviceRows`` (``_update_rows``), else request by request."""
        assert self.paged is not None and self.ring is not None, "compressor cache not bound"
        proj = ctx.backends["linear"].linear(x, self.kv_gate_weight)  # [T, 2 · series]: kv, then gate
        if not self.gated:  # one token per entry: its softmax weight is 1 whatever the gate
            proj = torch.cat([proj, torch.zeros_like(proj)], dim=-1)
        if isinstance(step_rows, _DeviceRows):
            self._update_rows(proj, ctx, step_rows, rotary)
            return
        size, r, dev = self.ring.shape[1], self.ratio, x.device
        per_block = self.paged.shape[1]
        for s in step_rows:
            w0, w1 = s.start // r, s.end // r
            if w1 > w0:
                first_window = w0 - 1 if self.overlap and w0 > 0 else w0
                older = self.ring[s.slot].index_select(0, ring_rows(first_window * r, s.start, size, dev))
                rows = torch.cat([older, proj[s.lo:s.lo + w1 * r - s.start]])
                entries = self._pool(rows, w0, w1, first_window, rotary)
                # A replay chunk may end wholly below the write floor: then it writes no entry.
                ids = torch.arange(min(w1, max(w0, -(-s.floor // r))), w1, device=dev)
                if ids.numel():
                    targets = entry_rows(ctx.block_tables[s.index], ids, per_block)
                    self._store(targets, entries[ids - w0])
            keep = min(s.hi - s.lo, size)
            write_rows(self.ring, s.slot * size + ring_rows(s.end - keep, s.end, size, dev), proj[s.hi - keep:s.hi])

    def _update_rows(self, proj: torch.Tensor, ctx: ForwardContext, rows: _DeviceRows, rotary: V4Rotary) -> None:
        """``update`` on device tensors only (no host list, so a CUDA graph can capture it), for steps of
        at most ``max_backtrack + 1`` query tokens per request (``device_rows``: decode and verification
        steps). Every row goes into its request's ring first: a step of n tokens at ``[s, s + n)``
        overwrites the ring rows of positions below ``s + n − size`` ≤ ``s + 1 − span``, older than any
        its windows read. Then every row pools the window its token falls in from the ring, as the
        per-request path pools it from the ring and the step's rows (same values, same ops: bitwise
        equal), and the rows that close their window write its entry; the others write theirs to the
        first entry of the reserved scratch block 0, which no request reads (a request's rows in one
        window share its entry's row, and ``index_copy_`` picks no winner among duplicates)."""
        assert self.paged is not None and self.ring is not None
        r, width, size = self.ratio, self.width, self.ring.shape[1]
        pos, slots = ctx.positions, rows.slots
        write_rows(self.ring, slots * size + pos % size, proj)
        ring = self.ring.view(-1, self.ring.shape[-1])
        window = pos // r
        span = self.ring_span()
        first = (window + 1) * r - span  # negative for entry 0 with overlap: those rows are masked below
        reads = slots.unsqueeze(1) * size + (first.unsqueeze(1) + torch.arange(span, device=pos.device)) % size
        kv, gate = ring.index_select(0, reads.flatten()).view(-1, span // r, r, 2 * self.series).split(self.series, -1)
        gate = gate + self.position_bias
        if self.overlap:  # Ca of the previous window, Cb of this one; entry 0 has no previous window
            no_prev = (window == 0).view(-1, 1, 1)
            prev_kv = kv[:, 0, :, :width].masked_fill(no_prev, 0)
            prev_gate = gate[:, 0, :, :width].masked_fill(no_prev, float("-inf"))
            kv = torch.cat([prev_kv, kv[:, 1, :, width:]], dim=1)
            gate = torch.cat([prev_gate, gate[:, 1, :, width:]], dim=1)
        else:
            kv, gate = kv[:, 0], gate[:, 0]
        entries = self._finish(kv, gate, window * r, rotary)
        per_block = self.paged.shape[1]
        blocks = ctx.block_tables[rows.requests, window // per_block]
        closes = (pos + 1) % r == 0
        targets = torch.where(closes, blocks * per_block + window % per_block, 0)
        self._store(targets, entries)

    def _finish(self, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, rotary: V4Rotary) -> torch.Tensor:
        """Entries from their windows' ``kv`` and biased ``gate`` ``[entries, slots, width]``: softmax over
        the slots per channel, the weighted sum, the norm, then rope at ``positions`` (window starts)."""
        probs = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        normed = self.norm((kv * probs).sum(dim=1))
        entries = rotary.rotate(normed, positions)
        if not self.index_writers:
            return entries
        keys = [keys_of(normed, positions).to(entries.dtype) for keys_of, _ in self.index_writers]
        return torch.cat([entries, *keys], dim=-1)

    def _store(self, targets: torch.Tensor, rows: torch.Tensor) -> None:
        """Write entry rows ``rows`` (with the index writers' keys appended, V4.1) at flat rows ``targets`` of
        the paged tensors, each in its own storage (model dtype, or a V4.1 layout: ``kv/v41_cache.py``)."""
        assert self.paged is not None
        v41_cache.write(self.paged, targets, rows[:, : self.width])
        if not self.index_writers:
            return
        key_width = (rows.shape[1] - self.width) // len(self.index_writers)
        for i, (_, paged) in enumerate(self.index_writers):
            start = self.width + i * key_width
            v41_cache.write(paged, targets, rows[:, start:start + key_width])

    def _pool(self, rows: torch.Tensor, w0: int, w1: int, first_window: int, rotary: V4Rotary) -> torch.Tensor:
        """Entries ``[w0, w1)`` from the projections of windows ``[first_window, w1)``."""
        r, width = self.ratio, self.width
        kv, gate = rows.view(w1 - first_window, r, -1).split(self.series, dim=-1)
        gate = gate + self.position_bias
        if self.overlap:
            prev_kv, prev_gate = kv[..., :width], gate[..., :width]  # Ca: feeds the next window's entry
            cur_kv, cur_gate = kv[..., width:], gate[..., width:]  # Cb: feeds its own window's entry
            if first_window == w0:  # entry 0 has no previous window: its Ca half gets softmax weight 0
                prev_kv = torch.cat([prev_kv.new_zeros(1, r, width), prev_kv[:-1]])
                prev_gate = torch.cat([prev_gate.new_full((1, r, width), float("-inf")), prev_gate[:-1]])
            else:
                prev_kv, prev_gate, cur_kv, cur_gate = prev_kv[:-1], prev_gate[:-1], cur_kv[1:], cur_gate[1:]
            kv = torch.cat([prev_kv, cur_kv], dim=1)
            gate = torch.cat([prev_gate, cur_gate], dim=1)
        return self._finish(kv, gate, torch.arange(w0, w1, device=rows.device) * r, rotary)


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own compressor of keys and a top-k over them (the
    scoring and top-k run in the backend op ``indexer_topk``)."""

    def __init__(self, d: V4Dims, ratio: int, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.heads, self.dim, self.topk, self.ratio = d.index_heads, d.index_dim, d.index_topk, ratio
        self.compressor = Compressor(d, d.index_dim, ratio, overlap=True, dtype=dtype, device=device)
        self.q_b_weight = nn.Parameter(torch.empty(d.index_heads * d.index_dim, d.q_lora, dtype=dtype, device=device))
        self.weights_weight = nn.Parameter(torch.empty(d.index_heads, d.hidden, dtype=dtype, device=device))

    def select(self, q_latent: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
               rotary: V4Rotary) -> torch.Tensor:
        """The entries ``[T, index_topk]`` each query attends to (−1: none), best first."""
        gemm = ctx.backends["linear"]
        q = rotary.rotate(gemm.linear(q_latent, self.q_b_weight).view(-1, self.heads, self.dim), positions)
        head_w = gemm.linear(x, self.weights_weight).float() * self.heads ** -0.5  # [T, heads]
        paged = self.compressor.paged
        assert paged is not None
        # Scoring and top-k are the backend op ``indexer_topk`` (reference: reference_deepseek_v4.py).
        return ctx.backends["indexer_topk"].indexer_topk(q, head_w, paged, ctx, ratio=self.ratio, topk=self.topk,
                                                         scale=self.dim ** -0.5)
