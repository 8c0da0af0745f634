"""DeepSeek-V4 attention (every layer).

One shared head ``kv = rope(kv_norm(kv_proj(x)))`` used as key and value; queries
``q_b(q_a_norm(q_a(x)))`` with an unweighted per-head RMSNorm; rope on the trailing
``qk_rope_head_dim = head_dim · partial_rotary_factor`` channels in the interleaved-pair layout;
per-head sinks; softmax scale ``head_dim**-0.5``; the output's rope channels are rotated back to
the query position; grouped low-rank output ``o_b(o_a_grouped(·))``. Sliding-window layers use the
"main" rope (``rope_theta``); CSA/HCA layers and their compressors the "compress" rope
(``compress_rope_theta``, YaRN with ``attention_factor`` 1). Besides the window of ``sliding_window``
tokens, CSA and HCA layers read the compressed entries of ``compressor.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.kv.state import CompressedPart, HybridLayerSpec, RingPart
from deepinfer.model.deepseek_v4.compressor import Compressor, Indexer
from deepinfer.model.deepseek_v4.config import CSA, SLIDING, V4Dims
from deepinfer.model.deepseek_v4.norm import V4RMSNorm, unweighted_rms_norm
from deepinfer.model.deepseek_v4.rotary import V4Rotary
from deepinfer.model.deepseek_v4.rows import StepRows


def add_projections(module: nn.Module, d: V4Dims, dtype: torch.dtype, device: torch.device | None) -> None:
    """The weights V4 and V4.1 attention share, registered on ``module``: the low-rank query
    (``qkv_a_weight`` also holds the shared key/value row), its norms, the grouped low-rank output and the
    per-head attention sinks (float32)."""
    kw = {"dtype": dtype, "device": device}
    module.qkv_a_weight = nn.Parameter(torch.empty(d.q_lora + d.head_dim, d.hidden, **kw))
    module.q_a_norm = V4RMSNorm(d.q_lora, d.eps, device=device)
    module.q_b_weight = nn.Parameter(torch.empty(d.heads * d.head_dim, d.q_lora, **kw))
    module.kv_norm = V4RMSNorm(d.head_dim, d.eps, device=device)
    module.o_a_weight = nn.Parameter(torch.empty(d.o_groups * d.o_lora, d.heads * d.head_dim // d.o_groups, **kw))
    module.o_b_weight = nn.Parameter(torch.empty(d.hidden, d.o_groups * d.o_lora, **kw))
    module.sinks = nn.Parameter(torch.empty(d.heads, dtype=torch.float32, device=device))


class V4Attention(nn.Module):
    def __init__(self, d: V4Dims, kind: str, rotary: V4Rotary, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.d = d
        kw = {"dtype": dtype, "device": device}
        self.kind = kind
        self.ratio = int(d.rates[kind])
        self.rotary = rotary
        add_projections(self, d, dtype, device)
        self.compressor = (Compressor(d, d.head_dim, self.ratio, overlap=self.kind == CSA, **kw)
                           if self.kind != SLIDING else None)
        self.indexer = Indexer(d, self.ratio, **kw) if self.kind == CSA else None
        self.scale = d.head_dim ** -0.5
        self.ring: torch.Tensor | None = None

    def cache_spec(self, role: str) -> HybridLayerSpec:
        d = self.d
        rings = [RingPart(d.window, d.head_dim, sliding=True)]
        paged = []
        for comp in (self.compressor, self.indexer.compressor if self.indexer else None):
            if comp is not None:
                paged.append(CompressedPart(comp.ratio, comp.width))
                rings.append(RingPart(comp.ring_span(), 2 * comp.series))
        kind = "sliding" if self.kind == SLIDING else "compressed"
        # cache.kv_dtype fp8: entries, indexer keys and the sliding ring in MXFP8 (kv/v41_cache.py).
        return HybridLayerSpec(tuple(paged), tuple(rings), kind, d.window, max(self.ratio, 1), role, ("fp8",))

    def bind(self, cache: tuple[torch.Tensor, ...]) -> None:
        comps = [c for c in (self.compressor, self.indexer.compressor if self.indexer else None) if c is not None]
        paged, rings = cache[: len(comps)], cache[len(comps):]
        self.ring = rings[0]
        for comp, p, ring in zip(comps, paged, rings[1:], strict=True):
            comp.paged, comp.ring = p, ring

    def forward(self, positions: torch.Tensor, x: torch.Tensor, source: torch.Tensor, ctx: ForwardContext,
                step_rows: StepRows, source_rows: tuple[ForwardContext, StepRows] | None = None) -> torch.Tensor:
        """``x [T, H]`` the attention input; ``source`` the compressors' input (``x``, or the YoCo shared
        hidden in consumer layers); ``source_rows`` the context and rows of ``source`` when they are not
        ``x``'s (truncated consumers: the compressors still see the whole step)."""
        source_ctx, source_step_rows = source_rows or (ctx, step_rows)
        d, gemm = self.d, ctx.backends["linear"]
        q_latent, kv = gemm.linear(x, self.qkv_a_weight).split([d.q_lora, d.head_dim], dim=-1)
        q_latent = self.q_a_norm(q_latent)
        q = unweighted_rms_norm(gemm.linear(q_latent, self.q_b_weight).view(-1, d.heads, d.head_dim), d.eps)
        q = self.rotary.rotate(q, positions)
        kv = self.rotary.rotate(self.kv_norm(kv), positions)
        compressed = selected = None
        if self.compressor is not None:
            self.compressor.update(source, source_ctx, source_step_rows, self.rotary)
            compressed = self.compressor.paged
        if self.indexer is not None:
            self.indexer.compressor.update(source, source_ctx, source_step_rows, self.rotary)
            selected = self.indexer.select(q_latent, x, positions, ctx, self.rotary)
        assert self.ring is not None, "attention cache not bound"
        out = ctx.backends["sink_attention"].sink_attention(
            q, kv, self.ring, ctx, window=d.window, scale=self.scale, sinks=self.sinks, compressed=compressed,
            ratio=max(self.ratio, 1), selected=selected)
        out = self.rotary.rotate(out, positions, inverse=True)
        groups = out.reshape(-1, d.o_groups, d.heads * d.head_dim // d.o_groups)
        grouped = torch.einsum("tgi,goi->tgo", groups, self.o_a_weight.view(d.o_groups, d.o_lora, -1))
        return gemm.linear(grouped.flatten(1), self.o_b_weight)
