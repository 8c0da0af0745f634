"""DeepSeek-V4.1 attention (``v41.py`` assembles the model): V4's query/key path without the per-head
query norm, C1/C2 compressed entries, the projected indexer with the candidate-block limit, and the
cross-layer sharing of entries, indexer keys and top-k (``CrossLayerState`` carries the step's top-k
and candidates from source layers to their consumers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.kv.state import CompressedPart, HybridLayerSpec, RingPart
from deepinfer.model.deepseek_v4.attention import add_projections
from deepinfer.model.deepseek_v4.compressor import Compressor
from deepinfer.model.deepseek_v4.norm import unweighted_rms_norm
from deepinfer.model.deepseek_v4.rotary import V4Rotary
from deepinfer.model.deepseek_v4.rows import StepRows
from deepinfer.model.deepseek_v4.v41_config import V41Dims
from deepinfer.model.deepseek_v4.v41_indexer import IndexKeys, IndexQuery, select


@dataclass
class CrossLayerState:
    """What one forward's source layers hand later layers: each index source's top-k and the candidate
    blocks, per row of the step (narrowed to the kept rows at a compact YoCo boundary)."""

    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None

    def narrow(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (the first consumer of a compact truncated step)."""
        self.topk = {k: v.index_select(0, rows) for k, v in self.topk.items()}
        if self.candidates is not None:
            self.candidates = self.candidates.index_select(0, rows)


class V41Attention(nn.Module):
    """One V4.1 attention layer (see the module docstring)."""

    def __init__(self, d: V41Dims, layer: int, rotary: V4Rotary, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.d, self.layer, self.rotary = d, layer, rotary
        self.ratio = d.ratios[layer]
        add_projections(self, d, dtype, device)
        self.compressor: Compressor | None = None
        if d.owns_kv(layer):
            self.compressor = Compressor(d, d.head_dim, self.ratio, overlap=False, ape=False, gated=self.ratio > 1,
                                         **kw)
        self.index_keys: IndexKeys | None = None
        if d.owns_index_k(layer):
            self.index_keys = IndexKeys(d, **kw)
            self.index_keys.rotary = rotary
        self.index_query = IndexQuery(d, **kw) if d.owns_topk(layer) else None
        self.scale = d.head_dim ** -0.5
        # V4 normalizes each query head (unweighted RMSNorm); the reference runs V4.1 without it
        # (``hugging_face/config.py``: ``use_qnorm: False``). An attribute so a test can match V4.
        self.q_norm = False
        self.ring: torch.Tensor | None = None
        self.kv_paged: torch.Tensor | None = None  # the KV source's entries and indexer keys (bind)
        self.index_paged: torch.Tensor | None = None

    def cache_spec(self, role: str) -> HybridLayerSpec:
        """The sliding ring; a KV source also its compressor ring and paged entries; an index-K source its
        paged indexer keys."""
        d = self.d
        rings, paged = [RingPart(d.window, d.head_dim, sliding=True)], []
        if self.compressor is not None:
            paged.append(CompressedPart(self.ratio, d.head_dim))
            rings.append(RingPart(self.compressor.ring_span(), 2 * self.compressor.series))
        if self.index_keys is not None:
            paged.append(CompressedPart(self.ratio, d.index_dim, index=True))
        kind = "compressed" if self.ratio else "sliding"
        # For replay planners the window is the layer's reach back: an Engram layer also reads the n − 1
        # tokens before each one (its n-grams), so exact replay starts that much earlier.
        engram = d.engram is not None and self.layer in d.engram.layer_ids
        reach = d.window + (d.engram.max_ngram - 1 if engram and d.engram is not None else 0)
        # Under cache.kv_dtype fp8 / fp4 entries, indexer keys and the sliding ring take V4.1's layouts
        # (kv/v41_cache.py), which the reference attention reads.
        return HybridLayerSpec(tuple(paged), tuple(rings), kind, reach, max(self.ratio, 1), role, ("fp8", "fp4"))

    def bind(self, cache: tuple[torch.Tensor, ...], kv_source: V41Attention, index_k_source: V41Attention) -> None:
        """Bind this layer's own tensors (``cache_spec``'s order: paged, then rings); a KV consumer reads
        ``kv_source``'s entries, an index-K consumer ``index_k_source``'s keys. An index-K source registers
        its key projection with its KV source's compressor, which writes the keys of every new entry."""
        parts = list(cache)
        entries = parts.pop(0) if self.compressor is not None else None
        keys = parts.pop(0) if self.index_keys is not None else None
        self.ring = parts[0]
        if self.compressor is not None:
            self.compressor.paged, self.compressor.ring = entries, parts[1]
            self.compressor.index_writers = []
        if not self.ratio:
            return
        self.kv_paged = entries if self.compressor is not None else kv_source.kv_paged
        if self.index_keys is not None:
            assert keys is not None and kv_source.compressor is not None, f"layer {self.layer}: KV source unbound"
            kv_source.compressor.index_writers.append((self.index_keys, keys))
            self.index_paged = keys
        else:
            self.index_paged = index_k_source.index_paged
        assert self.kv_paged is not None and self.index_paged is not None, f"layer {self.layer}: sources unbound"

    def forward(self, positions: torch.Tensor, x: torch.Tensor, source: torch.Tensor, ctx: ForwardContext,
                step_rows: StepRows, source_rows: tuple[ForwardContext, StepRows] | None,
                shared: CrossLayerState) -> torch.Tensor:
        """As ``V4Attention.forward``; ``shared`` carries the top-k and candidates between layers."""
        source_ctx, source_step_rows = source_rows or (ctx, step_rows)
        d, gemm = self.d, ctx.backends["linear"]
        q_latent, kv = gemm.linear(x, self.qkv_a_weight).split([d.q_lora, d.head_dim], dim=-1)
        q_latent = self.q_a_norm(q_latent)
        q = gemm.linear(q_latent, self.q_b_weight).view(-1, d.heads, d.head_dim)
        if self.q_norm:
            q = unweighted_rms_norm(q, d.eps)
        q = self.rotary.rotate(q, positions)
        kv = self.rotary.rotate(self.kv_norm(kv), positions)
        selected = None
        if self.compressor is not None:
            self.compressor.update(source, source_ctx, source_step_rows, self.rotary)
        if self.index_query is not None:
            assert self.index_paged is not None
            iq, head_w = self.index_query(q_latent, x, positions, ctx, self.rotary)
            limit = d.candidate
            role = ("source" if limit is not None and limit.source == self.layer
                    else "limited" if d.limited(self.layer) else "plain")
            selected, picked = select(iq, head_w, self.index_paged, ctx, ratio=self.ratio, topk=d.index_topk,
                                      scale=d.index_dim ** -0.5, limit=limit, role=role, candidates=shared.candidates)
            shared.topk[self.layer] = selected
            if picked is not None:
                shared.candidates = picked
        elif self.ratio:
            selected = shared.topk[d.index_source[self.layer]]
        assert self.ring is not None, "attention cache not bound"
        out = ctx.backends["sink_attention"].sink_attention(
            q, kv, self.ring, ctx, window=d.window, scale=self.scale, sinks=self.sinks,
            compressed=self.kv_paged if self.ratio else None, ratio=max(self.ratio, 1), selected=selected)
        out = self.rotary.rotate(out, positions, inverse=True)
        groups = out.reshape(-1, d.o_groups, d.heads * d.head_dim // d.o_groups)
        grouped = torch.einsum("tgi,goi->tgo", groups, self.o_a_weight.view(d.o_groups, d.o_lora, -1))
        return gemm.linear(grouped.flatten(1), self.o_b_weight)
