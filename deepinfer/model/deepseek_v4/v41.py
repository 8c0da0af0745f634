"""DeepSeek-V4.1-Flash decoder: ``DeepseekV41ForCausalLM`` (the reference's own model; no transformers oracle).

Built from V4's parts (``config.py`` → ``v41_config.py`` for the facts): V4's norms, rope, MoE (learned
top-k only), YoCo and state rings, with V4.1's differences (reference/deepinfer.md §6, §8, §11):

- attention: no per-head query RMSNorm (the reference's ``use_qnorm: False``; V4 has one); a layer of
  ``compress_ratios`` 0 is sliding-window only; 1 or 2 (C1/C2) adds compressed
  entries (``Compressor`` without overlap or position bias; C1 has no gate) and a projected indexer
  (``v41_indexer.py``) whose top-k entries each query sees besides its window;
- cross-layer sharing: a KV consumer has no compressor and reads its source's paged entries; an
  index-K consumer has no key projection and reads its source's keys (its source projects the keys of
  its KV source's new entries, in that compressor's step); a layer's cache spec holds paged parts only for
  what it owns, so the KV pool allocates entries and keys only for source layers; a top-k consumer has
  no indexer query and reuses its source's top-k of the same step; the candidate-block limit restricts
  the index sources after the candidate source;
- ``hc_shifted``: every sub-layer reads the streams through the pre-mix of the sub-layer before it (the
  first through stream 0 alone) and the model ends with the last sub-layer's pre-mix (no ``hc_head``);
- Engram (``engram.py``): at ``engram_layer_ids`` the n-gram memory is gated into the streams before the
  attention hyper-connection; the step's n-gram ids come from a per-slot ring of compressed ids.

Modules: ``v41_config.py`` (the config), ``v41_attention.py`` (attention and sharing), ``v41_indexer.py``
(indexer, candidate blocks), ``engram.py``, ``v41_weights.py`` (the reference's tensor names and loading);
this one holds the decoder block and the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.model import deepseek_v4 as v4_package
from deepinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.model.deepseek_v4.engram import (
    EngramLayer,
    NgramHistory,
    hash_multipliers,
    read_tokenizer_lookup,
    table_primes,
)
from deepinfer.model.deepseek_v4.fp4_moe import V4Fp4MoE
from deepinfer.model.deepseek_v4.hyper import HyperConnection, HyperHead
from deepinfer.model.deepseek_v4.moe import V4MoE
from deepinfer.model.deepseek_v4.norm import V4RMSNorm
from deepinfer.model.deepseek_v4.rotary import V4Rotary
from deepinfer.model.deepseek_v4.rows import (
    StepRows,
    _all_rows,
    _consumer_view,
    _ConsumerView,
    _DeviceRows,
    _segments,
    layer_stance,
)
from deepinfer.model.deepseek_v4.v41_attention import CrossLayerState, V41Attention
from deepinfer.model.deepseek_v4.v41_config import ARCH, EngramSpec, V41Dims
from deepinfer.model.deepseek_v4.v41_weights import load_v41_checkpoint


class V41DecoderLayer(nn.Module):
    """A V4.1 block: V4's, with V41Attention and (``hc_shifted``) the pre-mix of the sub-layer before."""

    def __init__(self, d: V41Dims, layer: int, rotary: V4Rotary, dtype: torch.dtype,
                 device: torch.device | None = None, engram: EngramLayer | None = None) -> None:
        super().__init__()
        self.layer, self.shifted = layer, d.hc_shifted
        self.engram = engram
        self.attn_hc = HyperConnection(d, device)
        self.ffn_hc = HyperConnection(d, device)
        self.input_layernorm = V4RMSNorm(d.hidden, d.eps, device)
        self.post_attention_layernorm = V4RMSNorm(d.hidden, d.eps, device)
        self.self_attn = V41Attention(d, layer, rotary, dtype, device)
        self.mlp = (V4Fp4MoE if d.expert_dtype == "fp4" else V4MoE)(d, layer, "moe", dtype, device)
        # A drafter's feature layer (``DeepseekV41ForCausalLM.capture_hidden``) keeps its input streams, after
        # the Engram memory (the reference stores the trunk the attention's pre-mix reads).
        self.keep_input = False
        self.kept_input: torch.Tensor | None = None

    def forward(self, streams: torch.Tensor, pre_in: torch.Tensor | None, positions: torch.Tensor,
                input_ids: torch.Tensor, ctx: ForwardContext, step_rows: StepRows, shared: torch.Tensor | None,
                shares: bool, view: _ConsumerView | None, cross: CrossLayerState, ngrams: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """As ``V4DecoderLayer.forward``; with ``hc_shifted``, ``pre_in [T, m]`` is the pre-mix the
        sub-layer before computed, and the third result is this layer's last pre-mix (else None). An
        Engram layer first gates its memory of ``ngrams [T, max_ngram]`` into the streams."""
        if self.engram is not None:
            assert ngrams is not None
            streams = self.engram(streams, ngrams, ctx.backends["linear"])
        if self.keep_input:
            self.kept_input = streams
        pre, post, comb = self.attn_hc.mixes(streams)
        h = self.input_layernorm(HyperConnection.collapse(pre_in if self.shifted else pre, streams))
        if shares:
            shared = h
        source_rows = None
        if view is not None:
            if shares and view.rows is not None:
                post, comb, h, streams, pre = (t.index_select(0, view.rows) for t in (post, comb, h, streams, pre))
                cross.narrow(view.rows)
            source_rows = (ctx, step_rows)
            ctx, step_rows, positions, input_ids = view.ctx, view.segments, view.positions, view.input_ids
        y = self.self_attn(positions, h, h if shared is None else shared, ctx, step_rows, source_rows, cross)
        streams = HyperConnection.write_back(post, comb, y, streams)
        ffn_pre, post, comb = self.ffn_hc.mixes(streams)
        y = self.mlp(self.post_attention_layernorm(HyperConnection.collapse(pre if self.shifted else ffn_pre, streams)),
                     input_ids, positions, ctx)
        return HyperConnection.write_back(post, comb, y, streams), shared, ffn_pre if self.shifted else None


class DeepseekV41ForCausalLM(DeepseekV4ForCausalLM):
    """DeepSeek-V4.1-Flash (see the module docstring): V4's model with V4.1's attention, cross-layer
    sharing, candidate-block limit and shifted hyper-connections."""

    architecture = ARCH
    backend_ops = frozenset({"linear", "sink_attention", "indexer_scores", "experts"})

    def __init__(self, hf_config: dict[str, Any], *, dtype: torch.dtype, device: torch.device,
                 max_positions: int) -> None:
        # Not V4's __init__ (it builds V4 layers): V4.1 builds its own under V4's attribute names, so V4's
        # cache, router-statistics and MTP-interface methods apply unchanged.
        nn.Module.__init__(self)
        self.captured_layers: tuple[int, ...] = ()
        self.captured_hidden: dict[int, torch.Tensor] = {}
        self.d = d = V41Dims(hf_config)
        self.ngram_history: NgramHistory | None = None
        self.vocab_size = d.vocab
        self._dtype, self._device = dtype, device
        self.embed_tokens = nn.Embedding(d.vocab, d.hidden, dtype=dtype, device=device)
        self.rotary_main = V4Rotary(d.rope_main, d.rope_dim, max_positions, device)
        self.rotary_compress = V4Rotary(d.rope_compress, d.rope_dim, max_positions, device)
        engrams = self._engram_layers(d.engram, dtype, device) if d.engram is not None else {}
        self.layers = nn.ModuleList(V41DecoderLayer(d, i, self._rotary(i), dtype, device, engrams.get(i))
                                    for i in range(d.layers))
        self.hc_head = None if d.hc_shifted else HyperHead(d, device)
        self.norm = V4RMSNorm(d.hidden, d.eps, device)
        self.lm_head = None if d.tied else nn.Parameter(torch.empty(d.vocab, d.hidden, dtype=dtype, device=device))
        self.mtp_layers = nn.ModuleList()  # DSpark layers are not loaded yet (module docstring)
        self.max_backtrack = 0
        self._expert_bookkeeping(device)

    def _engram_layers(self, spec: EngramSpec, dtype: torch.dtype, device: torch.device) -> dict[int, EngramLayer]:
        """The Engram layers and the n-gram history (``engram.py``)."""
        d = self.d
        lookup = None
        if spec.compressed_vocab is not None:
            assert spec.folder is not None
            lookup = read_tokenizer_lookup(Path(spec.folder), spec.compressed_vocab)
        pad = spec.pad_token if lookup is None else int(lookup[spec.pad_token])
        self.ngram_history = NgramHistory(spec.max_ngram, pad, lookup)
        primes = table_primes(spec.layer_ids, spec.max_ngram - 1, spec.heads, spec.vocab)
        hash_vocab = spec.compressed_vocab or d.vocab
        return {i: EngramLayer(i, d.hidden, d.hc_mult, primes[i], spec.head_dim,
                               hash_multipliers(i, spec.max_ngram, hash_vocab), d.eps, dtype, device)
                for i in spec.layer_ids}

    def bind_cache(self, caches: Sequence[tuple[torch.Tensor, ...]]) -> None:
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):  # sources come first
            layer.self_attn.bind(cache, self.layers[self.d.kv_source[i]].self_attn,
                                 self.layers[self.d.index_k_source[i]].self_attn)
        ring = self.layers[0].self_attn.ring
        assert ring is not None
        self.max_backtrack = ring.shape[1] - self.d.window
        if self.ngram_history is not None:  # one row of compressed ids per state slot
            self.ngram_history.bind(ring.shape[0], self.max_backtrack, ring.device)

    def capture_hidden(self, layer_ids: Sequence[int]) -> None:
        """As V4's: each chosen layer's feature rows are the mean of the streams entering its attention
        hyper-connection (after its Engram memory)."""
        super().capture_hidden(layer_ids)
        for i, layer in enumerate(self.layers):
            layer.keep_input = self.capture_features and i in self.captured_layers
            layer.kept_input = None

    def build_mtp_layers(self) -> None:
        """Refused: V4.1's DSpark layers are not built yet (docs/status.md, issue 32)."""
        raise ValueError(f"{ARCH}: DSpark/MTP layers are not supported yet (num_nextn_predict_layers is ignored)")

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # ``device_rows`` looked up through the package, as V4's forward does (tests swap it there).
        step_rows = _DeviceRows.of(ctx) if v4_package.device_rows(ctx, self.max_backtrack + 1) else _segments(ctx)
        x = self.embed_tokens(input_ids)
        m = self.d.hc_mult
        streams = x.unsqueeze(1).expand(-1, m, -1).contiguous()
        pre = None
        if self.d.hc_shifted:  # the first sub-layer reads stream 0 alone
            pre = torch.zeros(x.shape[0], m, dtype=torch.float32, device=x.device)
            pre[:, 0] = 1.0
        shared = view = None
        cross = CrossLayerState()
        ngrams = None
        if self.ngram_history is not None:
            ngrams = (self.ngram_history.ngrams_on_device(input_ids, ctx.positions, step_rows.slots)
                      if isinstance(step_rows, _DeviceRows) else self.ngram_history.ngrams(input_ids, step_rows))
        with layer_stance(step_rows):
            for i, layer in enumerate(self.layers):
                shares = i == self.d.yoco
                if shares and ctx.truncation_floor_host is not None:
                    assert not isinstance(step_rows, _DeviceRows)
                    view = _consumer_view(ctx, step_rows, input_ids)  # the layer narrows the streams and pre-mixes
                streams, shared, pre = layer(streams, pre, ctx.positions, input_ids, ctx, step_rows, shared, shares,
                                             view, cross, ngrams)
                if layer.keep_input:  # its input was narrowed only if a consumer before it narrowed the streams
                    assert layer.kept_input is not None
                    self._capture_streams(i, layer.kept_input, input_ids.shape[0], view if i > self.d.yoco else None)
                    layer.kept_input = None
        self._capture_streams(self.d.layers, streams, input_ids.shape[0], view)
        folded = HyperConnection.collapse(pre, streams) if pre is not None else self.hc_head(streams)
        return _all_rows(self.norm(folded), input_ids.shape[0], view)

    def gemm_weights(self) -> list[nn.Parameter]:
        """Weights used through the ``linear`` op."""
        out: list[nn.Parameter] = []
        for layer in self.layers:
            attn = layer.self_attn
            out += [attn.qkv_a_weight, attn.q_b_weight, attn.o_b_weight]
            if attn.compressor is not None:
                out.append(attn.compressor.kv_gate_weight)
            if attn.index_query is not None:
                out += [attn.index_query.q_b_weight, attn.index_query.weights_weight]
            if layer.mlp.shared_gate_up is not None:
                out += [layer.mlp.shared_gate_up, layer.mlp.shared_down]
            if layer.engram is not None:
                out.append(layer.engram.wkv_weight)
        return [*out, self.embed_tokens.weight if self.lm_head is None else self.lm_head]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Fill parameters from the reference's tensor names (``v41_weights.py``); returns those filled."""
        return load_v41_checkpoint(self, weights)
