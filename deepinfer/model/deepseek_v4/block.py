"""A DeepSeek-V4 decoder block: hyper-connections around attention and MoE.

YoCo (``yoco_num_producer_layers`` = N > 0, API.md §7): the attention-norm output of layer N is the
shared hidden; layers ≥ N compute their compressed entries, indexer keys and compressor state from
it (queries, indexer queries and weights, and sliding keys from their own input). Prefill truncation
(``ctx.truncation_floor_host``, reference/deepinfer.md §6): the consumers need queries only from each
request's floor on; their compressors still read the whole step's shared hidden, their windows see no
key below the floor, and in compact mode the first consumer narrows the streams to the kept rows (the
rows dropped come back from ``forward`` as zeros). Window keys below ``ctx.visibility_floor_host``
(a bounded restore) are invisible in every layer.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.model.deepseek_v4.attention import V4Attention
from deepinfer.model.deepseek_v4.config import V4Dims
from deepinfer.model.deepseek_v4.hyper import HyperConnection
from deepinfer.model.deepseek_v4.moe import V4MoE
from deepinfer.model.deepseek_v4.norm import V4RMSNorm
from deepinfer.model.deepseek_v4.rotary import V4Rotary
from deepinfer.model.deepseek_v4.rows import StepRows, _ConsumerView


class V4DecoderLayer(nn.Module):
    """A decoder block; ``kind``/``mlp_type`` default to the config's schedule for ``layer``."""

    def __init__(self, d: V4Dims, layer: int, rotary: V4Rotary, dtype: torch.dtype,
                 device: torch.device | None = None, kind: str | None = None, mlp_type: str | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.attn_hc = HyperConnection(d, device)
        self.ffn_hc = HyperConnection(d, device)
        self.input_layernorm = V4RMSNorm(d.hidden, d.eps, device)
        self.post_attention_layernorm = V4RMSNorm(d.hidden, d.eps, device)
        self.self_attn = V4Attention(d, kind or d.layer_types[layer], rotary, dtype, device)
        self.mlp = V4MoE(d, layer, mlp_type or d.mlp_types[layer], dtype, device)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor,
                ctx: ForwardContext, step_rows: StepRows, shared: torch.Tensor | None,
                shares: bool, view: _ConsumerView | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block on ``streams [T, m, H]``. ``shares``: this layer's attention input becomes the
        YoCo shared hidden; ``shared``: the shared hidden the compressors read (None: own input).
        ``view``: a truncated consumer's rows (the compressors still read the whole step's shared
        hidden); the first consumer narrows ``streams`` to them. Returns the new streams and the shared
        hidden for the next layers."""
        post, comb, collapsed = self.attn_hc(streams)
        h = self.input_layernorm(collapsed)
        if shares:
            shared = h
        source_rows = None
        if view is not None:
            if shares and view.rows is not None:
                post, comb, h, streams = (t.index_select(0, view.rows) for t in (post, comb, h, streams))
            source_rows = (ctx, step_rows)
            ctx, step_rows, positions, input_ids = view.ctx, view.segments, view.positions, view.input_ids
        y = self.self_attn(positions, h, h if shared is None else shared, ctx, step_rows, source_rows)
        streams = HyperConnection.write_back(post, comb, y, streams)
        post, comb, collapsed = self.ffn_hc(streams)
        y = self.mlp(self.post_attention_layernorm(collapsed), input_ids, positions, ctx)
        return HyperConnection.write_back(post, comb, y, streams), shared
