"""DeepSeek-V4 MTP.

Upstream ``mtp.{k}.*`` tensors (``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``norm``,
``hc_head_{fn,base,scale}`` and a decoder block under the layer names) load into ``mtp_layers``
(one ``V4MTPLayer`` per depth: sliding-window attention, learned-top-k MoE); tensors of a depth that
do not fit this structure drop that depth with a warning, and ``build_mtp_layers()`` creates
``num_nextn_predict_layers`` unfilled ones (``load_format=dummy``). A depth reads the main model's final
streams (the last layer's output, before ``hc_head``) and the next token: ``x[k] = e_proj(enorm(emb)) +
h_proj(hnorm(streams[k]))`` for every stream k → the block → its own ``hc_head`` → ``norm`` → the shared
head. transformers does not instantiate V4 MTP (it drops ``mtp.*`` on load), so there is no oracle for
it. The drafter interface is V3's (``deepseek_v3.py``), with V4's hidden: ``mtp_hidden(streams, next_ids,
positions, ctx)`` maps flattened streams ``[T, hc_mult·H]`` to the depth's output streams (the input
of the next chained draft), ``mtp_logits`` applies the depth's head to them, ``mtp_forward`` does both.
``bind_mtp_cache`` makes ``forward`` keep its final streams in ``captured_hidden[num_hidden_layers]``
(``captured_layers``), which the runner then hands the drafter as ``CommittedRows.hidden``. Each
depth's cache (``mtp_cache_specs``) is one sliding-key ring in the request's state slot, like a main
sliding layer's, so a rollback is again just the length going back. The ring row of position p
depends only on the main streams at p, so exact replay restores it whenever the main model's rows
from ``window`` positions before the restored length on are exact.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.model.deepseek_v4.block import V4DecoderLayer
from deepinfer.model.deepseek_v4.config import SLIDING, V4Dims
from deepinfer.model.deepseek_v4.hyper import HyperHead
from deepinfer.model.deepseek_v4.norm import V4RMSNorm
from deepinfer.model.deepseek_v4.rotary import V4Rotary
from deepinfer.model.deepseek_v4.rows import _segments


class V4MTPLayer(nn.Module):
    """One MTP depth as the upstream checkpoint stores it (see the module docstring); its block has
    sliding-window attention and a learned-top-k MoE."""

    def __init__(self, d: V4Dims, rotary: V4Rotary, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.m, self.hidden = d.hc_mult, d.hidden
        self.enorm = V4RMSNorm(d.hidden, d.eps, device)
        self.hnorm = V4RMSNorm(d.hidden, d.eps, device)
        self.e_proj_weight = nn.Parameter(torch.empty(d.hidden, d.hidden, **kw))
        self.h_proj_weight = nn.Parameter(torch.empty(d.hidden, d.hidden, **kw))
        self.norm = V4RMSNorm(d.hidden, d.eps, device)
        self.hc_head = HyperHead(d, device)
        self.block = V4DecoderLayer(d, d.layers, rotary, dtype, device, kind=SLIDING, mlp_type="moe")

    def forward(self, streams: torch.Tensor, next_token_ids: torch.Tensor, embedded: torch.Tensor,
                positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Flattened streams ``[T, m·H]`` at ``positions`` and the embedded next tokens ``[T, H]`` →
        this depth's output streams ``[T, m·H]``; writes the block's ring rows of those positions."""
        gemm = ctx.backends["linear"]
        e = gemm.linear(self.enorm(embedded), self.e_proj_weight)
        h = gemm.linear(self.hnorm(streams.reshape(-1, self.hidden)), self.h_proj_weight).view(-1, self.m, self.hidden)
        out, _ = self.block(e.unsqueeze(1) + h, positions, next_token_ids, ctx, _segments(ctx), None, False)
        return out.flatten(1)

    def head_input(self, streams: torch.Tensor) -> torch.Tensor:
        """The normed hidden ``[T, H]`` the shared LM head reads, from output streams ``[T, m·H]``."""
        return self.norm(self.hc_head(streams.view(-1, self.m, self.hidden)))
