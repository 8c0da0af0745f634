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

Weights load under the reference's tensor names (``hugging_face/names.py``): V4's upstream names with
``attn.kv_norm`` (V4: ``attn.norm``), ``attn.indexer.{wk,k_norm}``, no compressor ``ape``, and
``engram.{q_weight,k_weight,wkv.weight,embed.weight}`` (the table memory-mapped); a missing
or extra tensor is an error naming it. DSpark layers (``mtp.{i}.*``) are not loaded yet: they are
skipped with a warning (the ``dspark`` drafter needs the DSpark issue's ring context). Image tensors
(``vision_pipeline.*``, ``image_*``, ``ffn.gate.bias_vl``) belong to the vision side this text model
does not run, and are skipped with an info line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepinfer.interfaces import ForwardContext
from deepinfer.kv.state import CompressedPart, HybridLayerSpec, RingPart
from deepinfer.model import deepseek_v4 as v4_package
from deepinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.model.deepseek_v4.compressor import Compressor
from deepinfer.model.deepseek_v4.engram import (
    EngramLayer,
    NgramHistory,
    hash_multipliers,
    mmap_safetensor,
    read_tokenizer_lookup,
    table_primes,
)
from deepinfer.model.deepseek_v4.hyper import HyperConnection, HyperHead
from deepinfer.model.deepseek_v4.moe import V4MoE
from deepinfer.model.deepseek_v4.norm import V4RMSNorm, unweighted_rms_norm
from deepinfer.model.deepseek_v4.rotary import V4Rotary
from deepinfer.model.deepseek_v4.rows import StepRows, _all_rows, _consumer_view, _ConsumerView, _DeviceRows, _segments
from deepinfer.model.deepseek_v4.v41_config import ARCH, EngramSpec, V41Dims
from deepinfer.model.deepseek_v4.v41_indexer import IndexKeys, IndexQuery, select
from deepinfer.model.deepseek_v4.weights import _copy, _half, module_tensors

logger = logging.getLogger(__name__)


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
        self.qkv_a_weight = nn.Parameter(torch.empty(d.q_lora + d.head_dim, d.hidden, **kw))
        self.q_a_norm = V4RMSNorm(d.q_lora, d.eps, device=device)
        self.q_b_weight = nn.Parameter(torch.empty(d.heads * d.head_dim, d.q_lora, **kw))
        self.kv_norm = V4RMSNorm(d.head_dim, d.eps, device=device)
        self.o_a_weight = nn.Parameter(torch.empty(d.o_groups * d.o_lora, d.heads * d.head_dim // d.o_groups, **kw))
        self.o_b_weight = nn.Parameter(torch.empty(d.hidden, d.o_groups * d.o_lora, **kw))
        self.sinks = nn.Parameter(torch.empty(d.heads, dtype=torch.float32, device=device))
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
        rings, paged = [RingPart(d.window, d.head_dim)], []
        if self.compressor is not None:
            paged.append(CompressedPart(self.ratio, d.head_dim))
            rings.append(RingPart(self.compressor.ring_span(), 2 * self.compressor.series))
        if self.index_keys is not None:
            paged.append(CompressedPart(self.ratio, d.index_dim))
        kind = "compressed" if self.ratio else "sliding"
        # For replay planners the window is the layer's reach back: an Engram layer also reads the n − 1
        # tokens before each one (its n-grams), so exact replay starts that much earlier.
        engram = d.engram is not None and self.layer in d.engram.layer_ids
        reach = d.window + (d.engram.max_ngram - 1 if engram and d.engram is not None else 0)
        return HybridLayerSpec(tuple(paged), tuple(rings), kind, reach, max(self.ratio, 1), role)

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
        self.mlp = V4MoE(d, layer, "moe", dtype, device)

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


# ------------------------------------------------------------------------------------ checkpoint names

_V41_ATTN = {
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_weight",
    "attn.wo_b.weight": "self_attn.o_b_weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.norm.weight": "self_attn.compressor.norm.weight",
    "attn.indexer.wk.weight": "self_attn.index_keys.wk_weight",
    "attn.indexer.k_norm.weight": "self_attn.index_keys.k_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.index_query.q_b_weight",
    "attn.indexer.weights_proj.weight": "self_attn.index_query.weights_weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.gate.weight": "mlp.gate_weight",
    "ffn.gate.bias": "mlp.e_score_correction_bias",
    **{f"hc_{site}_{leaf}": f"{site}_hc.{leaf}" for site in ("attn", "ffn") for leaf in ("fn", "base", "scale")},
}
_V41_TOP = {"embed.weight": "embed_tokens.weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.fn",
            "hc_head_base": "hc_head.base", "hc_head_scale": "hc_head.scale"}
_VISION_ONLY = ("vision_pipeline.", "image_start", "image_end", "image_newline")


def v41_layer_target(d: V41Dims, rest: str, prefix: str, tensors: dict[str, torch.Tensor]
                     ) -> tuple[str, torch.Tensor] | None:
    """``(parameter name, the view to fill)`` for a V4.1 per-layer name ``rest`` (after ``layers.L.``);
    None if the layer has no such tensor."""

    def whole(name: str) -> tuple[str, torch.Tensor] | None:
        return (prefix + name, tensors[prefix + name]) if prefix + name in tensors else None

    def view(name: str, pick: Any) -> tuple[str, torch.Tensor] | None:
        found = whole(name)
        return None if found is None else (found[0], pick(found[1]))

    if rest in _V41_ATTN:
        return whole(_V41_ATTN[rest])
    if rest == "attn.wq_a.weight":
        return view("self_attn.qkv_a_weight", lambda t: t[: d.q_lora])
    if rest == "attn.wkv.weight":
        return view("self_attn.qkv_a_weight", lambda t: t[d.q_lora:])
    if rest in ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight"):
        found = whole("self_attn.compressor.kv_gate_weight")
        if found is None:
            return None
        if found[1].shape[0] == 2 * d.head_dim:  # gated (C2): [wkv; wgate]
            return found[0], _half(found[1], int(rest.endswith("wgate.weight")))
        return found if rest.endswith("wkv.weight") else None  # C1 has no gate
    if rest in ("engram.q_weight", "engram.k_weight", "engram.wkv.weight"):
        return whole({"engram.q_weight": "engram.q_weight", "engram.k_weight": "engram.k_weight",
                      "engram.wkv.weight": "engram.wkv_weight"}[rest])
    if rest.startswith("ffn.shared_experts."):
        leaf = rest[len("ffn.shared_experts."):]
        if leaf == "w2.weight":
            return whole("mlp.shared_down")
        if leaf in ("w1.weight", "w3.weight"):
            return view("mlp.shared_gate_up", lambda t: _half(t, int(leaf == "w3.weight")))
        return None
    if rest.startswith("ffn.experts."):
        _, _, e, leaf = rest.split(".", 3)
        if leaf == "w2.weight":
            return view("mlp.w2", lambda t: t[int(e)])
        if leaf in ("w1.weight", "w3.weight"):
            return view("mlp.w13", lambda t: _half(t[int(e)], int(leaf == "w3.weight")))
    return None


class DeepseekV41ForCausalLM(DeepseekV4ForCausalLM):
    """DeepSeek-V4.1-Flash (see the module docstring): V4's model with V4.1's attention, cross-layer
    sharing, candidate-block limit and shifted hyper-connections."""

    architecture = ARCH

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
        self.expert_ids = d.expert_ids if d.sharded else None
        self.moe_layer_ids = list(range(d.layers))
        self.register_buffer("router_stats", torch.zeros(d.layers, d.n_routed, dtype=torch.int64, device=device),
                             persistent=False)
        for row, layer in enumerate(self.layers):
            layer.mlp.stats = self.router_stats[row]

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

    def build_mtp_layers(self) -> None:
        """Refused: V4.1's DSpark layers are not built yet (docs/status.md, issue 32)."""
        raise ValueError(f"{ARCH}: DSpark/MTP layers are not supported yet (num_nextn_predict_layers is ignored)")

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{ARCH}: its indexer, candidate blocks and Engram n-grams read the step's per-request "
                               "host lists, which a CUDA graph replay does not refresh; set kernels.cuda_graphs=false")
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
            segments = _segments(ctx) if isinstance(step_rows, _DeviceRows) else step_rows
            ngrams = self.ngram_history.ngrams(input_ids, segments)
        for i, layer in enumerate(self.layers):
            shares = i == self.d.yoco
            if shares and ctx.truncation_floor_host is not None:
                assert not isinstance(step_rows, _DeviceRows)
                view = _consumer_view(ctx, step_rows, input_ids)  # the layer narrows the streams and pre-mixes
            streams, shared, pre = layer(streams, pre, ctx.positions, input_ids, ctx, step_rows, shared, shares, view,
                                         cross, ngrams)
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
        """Fill parameters from the reference's tensor names (module docstring); a tensor that is not
        ours, or a parameter left unfilled, is an error naming it."""
        tensors = module_tensors(self)
        filled: dict[str, int] = {}
        skipped_mtp = skipped_vision = 0
        folder = None if self.d.engram is None or self.d.engram.folder is None else Path(self.d.engram.folder)
        for stored_name, tensor in weights:
            name = stored_name.removeprefix("model.")
            if name.startswith("mtp."):
                skipped_mtp += 1
                continue
            if name.startswith(_VISION_ONLY) or name.endswith("ffn.gate.bias_vl"):
                skipped_vision += 1
                continue
            dest: tuple[str, torch.Tensor] | None = None
            if name == "head.weight":
                if self.lm_head is None:
                    raise ValueError(f"weight {name!r}: config.json has tie_word_embeddings=true")
                dest = ("lm_head", self.lm_head.data)
            elif name in _V41_TOP and _V41_TOP[name] in tensors:
                dest = (_V41_TOP[name], tensors[_V41_TOP[name]])
            elif name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                engram = self.layers[int(idx)].engram if int(idx) < self.d.layers else None
                if rest == "engram.embed.weight" and engram is not None:
                    mapped = None if folder is None else mmap_safetensor(folder, stored_name)
                    engram.set_table(tensor if mapped is None else mapped)  # host memory, never a parameter
                    continue
                if int(idx) < self.d.layers:
                    dest = v41_layer_target(self.d, rest, f"layers.{idx}.", tensors)
            if dest is None:
                raise ValueError(f"weight {name!r} does not belong to {ARCH}")
            _copy(name, dest, tensor, filled)
        if skipped_mtp:
            logger.warning("%s: %d DSpark tensors (mtp.*) not loaded: DSpark heads are not supported yet", ARCH,
                           skipped_mtp)
        if skipped_vision:
            logger.info("%s: %d vision tensors skipped (text-only model)", ARCH, skipped_vision)
        params = dict(self.named_parameters())
        missing = [n for n, p in params.items() if filled.get(n, 0) < p.numel()]
        missing += [f"layers.{layer.layer}.engram.embed.weight" for layer in self.layers
                    if layer.engram is not None and layer.engram.table is None]
        if missing:
            raise ValueError(f"checkpoint has no tensor for {ARCH} parameter {missing[0]!r}"
                             f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
        return set(params)

