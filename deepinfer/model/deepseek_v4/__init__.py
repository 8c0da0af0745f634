"""DeepSeek-V4 decoder: ``DeepseekV4ForCausalLM`` (oracle: transformers ≥ 5.24, ``reference/oracles.md`` §1b).

The package holds one part per module; this module assembles them into the model:

- ``config.py``: ``V4Dims``, the config's shape, layer schedule (``SLIDING``/``CSA``/``HCA``) and rope sets;
- ``norm.py``, ``rotary.py``: the RMSNorms and the interleaved-pair rope;
- ``hyper.py``: the mHC hyper-connections (``HyperConnection``, ``HyperHead``);
- ``rows.py``: how a step's rows reach the layers (segments, ``device_rows``, the YoCo consumer view);
- ``compressor.py``: the HCA/CSA compressors and the lightning indexer, with the cache layout;
- ``attention.py``: ``V4Attention``, the sliding window plus compressed entries with sinks;
- ``moe.py``: ``V4MoE``, learned top-k and hash routing with shared experts;
- ``block.py``: ``V4DecoderLayer``, the block and YoCo's shared hidden;
- ``mtp.py``: ``V4MTPLayer``, one MTP depth;
- ``weights.py``: checkpoint tensor names (transformers' and upstream) and loading.

The residual is ``hc_mult`` streams ``[T, m, H]`` (the embedding copied m times), folded by ``hc_head``
before the last RMSNorm and the LM head. ``bind_mtp_cache`` makes ``forward`` keep its final streams in
``captured_hidden[num_hidden_layers]`` (``captured_layers``), which the runner hands the MTP drafter as
``CommittedRows.hidden``; each MTP depth's cache (``mtp_cache_specs``) is one sliding-key ring in the
request's state slot. ``capture_hidden`` instead keeps chosen layers' stream means (a ``dspark`` drafter's
features, one row per token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.kv.state import HybridLayerSpec
from deepinfer.model.base import StackedDecoderLM
from deepinfer.model.deepseek_v3 import in_main_layer
from deepinfer.model.deepseek_v4.attention import V4Attention
from deepinfer.model.deepseek_v4.block import V4DecoderLayer
from deepinfer.model.deepseek_v4.compressor import Compressor, Indexer
from deepinfer.model.deepseek_v4.config import _SCORE_FNS, CSA, HCA, SLIDING, V4Dims
from deepinfer.model.deepseek_v4.hyper import HyperConnection, HyperHead
from deepinfer.model.deepseek_v4.moe import V4MoE
from deepinfer.model.deepseek_v4.mtp import V4MTPLayer
from deepinfer.model.deepseek_v4.norm import V4RMSNorm, unweighted_rms_norm
from deepinfer.model.deepseek_v4.rotary import V4Rotary
from deepinfer.model.deepseek_v4.rows import (
    StepRows,
    _all_rows,
    _consumer_view,
    _ConsumerView,
    _DeviceRows,
    _Segment,
    _segments,
    device_rows,
    layer_stance,
)
from deepinfer.model.deepseek_v4.weights import load_checkpoint

__all__ = [
    "CSA", "HCA", "SLIDING", "_SCORE_FNS", "Compressor", "DeepseekV4ForCausalLM", "HyperConnection", "HyperHead",
    "Indexer", "StepRows", "V4Attention", "V4DecoderLayer", "V4Dims", "V4MTPLayer", "V4MoE", "V4RMSNorm",
    "V4Rotary", "_ConsumerView", "_DeviceRows", "_Segment", "_segments", "device_rows", "unweighted_rms_norm",
]


class DeepseekV4ForCausalLM(StackedDecoderLM):
    """DeepSeek-V4: mHC streams, sliding + compressed (CSA/HCA) attention with sinks, sqrt-softplus and
    hash MoE; per-request state in state slots, compressed entries paged (see the module docstring)."""

    architecture = "DeepseekV4ForCausalLM"
    backend_ops = frozenset({"linear", "sink_attention", "indexer_topk", "experts"})

    def __init__(self, hf_config: dict[str, Any], *, dtype: torch.dtype, device: torch.device,
                 max_positions: int) -> None:
        super().__init__()
        self.d = d = V4Dims(hf_config)
        self.vocab_size = d.vocab
        self._dtype, self._device = dtype, device
        self.embed_tokens = nn.Embedding(d.vocab, d.hidden, dtype=dtype, device=device)
        self.rotary_main = V4Rotary(d.rope_main, d.rope_dim, max_positions, device)
        self.rotary_compress = V4Rotary(d.rope_compress, d.rope_dim, max_positions, device)
        self.layers = nn.ModuleList(V4DecoderLayer(d, i, self._rotary(i), dtype, device) for i in range(d.layers))
        self.hc_head = HyperHead(d, device)
        self.norm = V4RMSNorm(d.hidden, d.eps, device)
        self.lm_head = None if d.tied else nn.Parameter(torch.empty(d.vocab, d.hidden, dtype=dtype, device=device))
        self.mtp_layers = nn.ModuleList()  # filled by load_weights when the checkpoint has MTP weights
        self.max_backtrack = 0  # the rings' rows past their span (cache.max_backtrack), known at bind_cache
        self._expert_bookkeeping(device)

    def _expert_bookkeeping(self, device: torch.device | None) -> None:
        """The experts the loader reads on an expert-parallel rank (``model/loader.py``), the MoE layers, and
        the router statistics each layer's MLP counts into (once ``self.layers`` exist)."""
        d = self.d
        self.expert_ids = d.expert_ids if d.sharded else None
        self.moe_layer_ids = list(range(d.layers))
        self.register_buffer("router_stats", torch.zeros(d.layers, d.n_routed, dtype=torch.int64, device=device),
                             persistent=False)
        for row, layer in enumerate(self.layers):
            layer.mlp.stats = self.router_stats[row]

    def _rotary(self, layer: int) -> V4Rotary:
        return self.rotary_main if self.d.layer_types[layer] == SLIDING else self.rotary_compress

    # Whether ``captured_layers`` are drafter features (``capture_hidden``: one row per token) rather than the
    # MTP layers' input (``bind_mtp_cache``: the final streams, flattened).
    capture_features: bool = False

    def capture_hidden(self, layer_ids: Sequence[int]) -> None:
        """Keep, from the next ``forward`` on, each chosen layer's feature rows ``[T, hidden]`` in
        ``captured_hidden`` for a drafter (``dspark``): the layers pass hyper-connection streams, so a
        layer's feature is the mean of the ``hc_mult`` streams entering it (its attention input's residual
        trunk, as the reference's ``dflash_input_store``); id ``num_hidden_layers``: the final streams'
        mean. Replaces the MTP capture of ``bind_mtp_cache``."""
        bad = [i for i in layer_ids if not 0 <= i <= len(self.layers)]
        if bad:
            raise ValueError(f"capture_hidden: layer ids {bad} are outside [0, {len(self.layers)}]")
        self.captured_layers = tuple(layer_ids)
        self.captured_hidden = {}
        self.capture_features = bool(layer_ids)

    def _capture_streams(self, layer: int, streams: torch.Tensor, num_tokens: int, view: _ConsumerView | None) -> None:
        """Keep the feature rows of ``streams [T', m, H]`` entering ``layer`` when it is captured (``view``:
        the YoCo consumer view when ``streams`` were narrowed to its rows)."""
        if self.capture_features and layer in self.captured_layers:
            rows = streams.float().mean(dim=1).to(self.embed_tokens.weight.dtype)
            self.captured_hidden[layer] = _all_rows(rows, num_tokens, view)

    # ------------------------------------------------------------------------------------------ cache

    def cache_specs(self) -> Sequence[HybridLayerSpec]:
        return [layer.self_attn.cache_spec(self.d.role(i)) for i, layer in enumerate(self.layers)]

    def bind_cache(self, caches: Sequence[tuple[torch.Tensor, ...]]) -> None:
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.bind(cache)
        ring = self.layers[0].self_attn.ring
        assert ring is not None
        # Every ring holds its span + cache.max_backtrack rows (kv/state.py); the sliding one's span is the window.
        self.max_backtrack = ring.shape[1] - self.d.window

    def shards_weight(self, name: str) -> bool:
        """Whether the expert shard covers checkpoint tensor ``name``'s routed experts (``model/loader.py``)."""
        return in_main_layer(name, self.d.layers)

    @staticmethod
    def mtp_weight(name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to an MTP layer (the upstream ``mtp.{k}.…``)."""
        return name.removeprefix("model.").startswith("mtp.")

    def take_router_stats(self) -> torch.Tensor:
        """Tokens routed to each expert ``[layers, n_routed]`` since the last call; zeroes the buffer."""
        out = self.router_stats.clone()
        self.router_stats.zero_()
        return out

    # ---------------------------------------------------------------------------------------- forward

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        step_rows = _DeviceRows.of(ctx) if device_rows(ctx, self.max_backtrack + 1) else _segments(ctx)
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.d.hc_mult, -1).contiguous()
        shared = view = None
        with layer_stance(step_rows):
            for i, layer in enumerate(self.layers):
                self._capture_streams(i, streams, input_ids.shape[0], view)  # view: set once a consumer narrowed them
                shares = bool(self.d.yoco) and i == self.d.yoco
                if shares and ctx.truncation_floor_host is not None:
                    assert not isinstance(step_rows, _DeviceRows)  # device_rows refuses truncated steps
                    view = _consumer_view(ctx, step_rows, input_ids)
                streams, shared = layer(streams, ctx.positions, input_ids, ctx, step_rows, shared, shares, view)
        hidden = self.norm(self.hc_head(streams))
        self._capture_streams(self.d.layers, streams, input_ids.shape[0], view)
        if self.captured_layers and not self.capture_features:  # the MTP layers' input (bind_mtp_cache)
            self.captured_hidden[self.d.layers] = _all_rows(streams.flatten(1), input_ids.shape[0], view)
        return _all_rows(hidden, input_ids.shape[0], view)

    # -------------------------------------------------------------------------------------------- MTP

    def mtp_cache_specs(self) -> Sequence[HybridLayerSpec]:
        """One sliding-key ring per loaded MTP layer (empty without MTP weights); not in ``cache_specs``."""
        return [layer.block.self_attn.cache_spec("plain") for layer in self.mtp_layers]

    def bind_mtp_cache(self, caches: Sequence[tuple[torch.Tensor, ...]]) -> None:
        """Bind the MTP layers' rings, and from now on keep each forward's final streams (their input)
        in ``captured_hidden[num_hidden_layers]``."""
        for layer, cache in zip(self.mtp_layers, caches, strict=True):
            layer.block.self_attn.bind(cache)
        self.captured_layers = (self.d.layers,)
        self.captured_hidden = {}
        self.capture_features = False

    def build_mtp_layers(self) -> None:
        """Create the ``num_nextn_predict_layers`` MTP layers, unfilled, if there are none yet (dummy
        weights fill them; ``load_weights`` builds them from the checkpoint)."""
        if not self.mtp_layers:
            self.mtp_layers.extend(V4MTPLayer(self.d, self.rotary_main, self._dtype, self._device)
                                   for _ in range(self.d.num_mtp))

    def mtp_hidden(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor,
                   ctx: ForwardContext, depth: int = 0) -> torch.Tensor:
        """MTP layer ``depth``'s output streams ``[T, hc_mult·H]`` from the flattened streams ``hidden``
        (the main model's final ones, or a previous MTP output) of the tokens at ``positions`` and the ids
        of the tokens after them; ``ctx`` covers those rows (with their state slots)."""
        return self.mtp_layers[depth](hidden, next_token_ids, self.embed_tokens(next_token_ids), positions, ctx)

    def mtp_logits(self, hidden: torch.Tensor, ctx: ForwardContext, depth: int = 0) -> torch.Tensor:
        """Float32 logits ``[T, V]`` of MTP layer ``depth``'s output streams ``hidden [T, hc_mult·H]``."""
        return self.compute_logits(self.mtp_layers[depth].head_input(hidden), ctx)

    def mtp_forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor,
                    ctx: ForwardContext, depth: int = 0) -> torch.Tensor:
        """Float32 logits ``[T, V]`` of MTP layer ``depth`` for the token after ``next_token_ids``."""
        return self.mtp_logits(self.mtp_hidden(hidden, next_token_ids, positions, ctx, depth), ctx, depth)

    def gemm_weights(self) -> list[nn.Parameter]:
        """Weights used through the ``linear`` op (not the grouped ``o_a``, experts, router, HC)."""
        out: list[nn.Parameter] = []
        blocks = [*self.layers, *(m.block for m in self.mtp_layers)]
        out += [w for m in self.mtp_layers for w in (m.e_proj_weight, m.h_proj_weight)]
        for layer in blocks:
            attn = layer.self_attn
            out += [attn.qkv_a_weight, attn.q_b_weight, attn.o_b_weight]
            if attn.compressor is not None:
                out.append(attn.compressor.kv_gate_weight)
            if attn.indexer is not None:
                out += [attn.indexer.q_b_weight, attn.indexer.weights_weight, attn.indexer.compressor.kv_gate_weight]
            if layer.mlp.shared_gate_up is not None:
                out += [layer.mlp.shared_gate_up, layer.mlp.shared_down]
        return [*out, self.embed_tokens.weight if self.lm_head is None else self.lm_head]

    # ---------------------------------------------------------------------------------------- weights

    # ---------------------------------------------------------------------------------------- weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Fill parameters from transformers' saved names or the upstream names (``weights.py``); returns
        those filled."""
        return load_checkpoint(self, weights)

