"""DeepSeek-V4 decoder: ``DeepseekV4ForCausalLM`` (oracle: transformers ≥ 5.24, ``reference/oracles.md`` §1b).

Residual: mHC hyper-connections. The residual is ``hc_mult`` streams ``[T, m, H]`` (the embedding
copied m times). Around each sub-layer (attention, then MoE) a hyper-connection reads the
RMS-normalized flattened streams through one projection ``fn [(2+m)·m, m·H]`` (times ``scale``, plus
``base``) and yields ``pre = sigmoid(·) + eps`` (mixes the streams into the sub-layer input),
``post = 2·sigmoid(·)`` (spreads the output back) and ``comb = softmax(·) + eps`` made doubly
stochastic by Sinkhorn (column normalization, then ``hc_sinkhorn_iters − 1`` row/column rounds).
New streams: ``out[k] = post[k]·y + Σ_j comb[j, k]·streams[j]``. The final ``hc_head`` folds the
streams with its own ``pre`` weights before the last RMSNorm.

Attention (every layer): one shared head ``kv = rope(kv_norm(kv_proj(x)))`` used as key and value;
queries ``q_b(q_a_norm(q_a(x)))`` with an unweighted per-head RMSNorm; rope on the trailing
``qk_rope_head_dim = head_dim · partial_rotary_factor`` channels in the interleaved-pair layout;
per-head sinks; softmax scale ``head_dim**-0.5``; the output's rope channels are rotated back to
the query position; grouped low-rank output ``o_b(o_a_grouped(·))``. Sliding-window layers use the
"main" rope (``rope_theta``); CSA/HCA layers and their compressors the "compress" rope
(``compress_rope_theta``, YaRN with ``attention_factor`` 1). Besides the window of ``sliding_window``
tokens:

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

MoE (every layer): routed experts through the backend op ``experts`` with ``swiglu_limit`` (gate
clamped above, up on both sides) plus the shared experts (same clamp; one MLP of width
``moe_intermediate_size × n_shared_experts``, the reference's concatenation — transformers ignores
``n_shared_experts``, which is 1 in every published V4 config). Scores are
``scoring_func(x·Wᵀ)`` in float32 (``sqrtsoftplus`` = sqrt(softplus), ``sigmoid`` or ``softmax``);
``moe`` layers take top-k of ``score + e_score_correction_bias``, ``hash_moe`` layers the frozen
table ``tid2eid[token]``; weights are the chosen scores over their sum (+1e-20) times
``routed_scaling_factor``. ``kernels.force_balanced_routing`` replaces the learned top-k (not the
hash tables) with a uniform draw, as for V3. ``router_stats``/``take_router_stats``, expert parallelism
(``expert_parallel``, with the ``swiglu_limit``) and expert shards (``deepinfer_expert_shard``) as in V3.

YoCo (``yoco_num_producer_layers`` = N > 0, API.md §7): the attention-norm output of layer N is the
shared hidden; layers ≥ N compute their compressed entries, indexer keys and compressor state from
it (queries, indexer queries and weights, and sliding keys from their own input). Prefill truncation
(``ctx.truncation_floor_host``, reference/deepinfer.md §6): the consumers need queries only from each
request's floor on; their compressors still read the whole step's shared hidden, their windows see no
key below the floor, and in compact mode the first consumer narrows the streams to the kept rows (the
rows dropped come back from ``forward`` as zeros). Window keys below ``ctx.visibility_floor_host``
(a bounded restore) are invisible in every layer.

Weights load under the names transformers saves (``model.layers.L.attn.wq_a.weight``,
``model.layers.L.ffn.experts.E.w1.weight``, ``model.hc_head.hc_fn``, ``head.weight``, …) and the
upstream un-prefixed names (``layers.L.…``, ``embed.weight``, ``hc_head_fn``, ``norm.weight``).
MTP: upstream ``mtp.{k}.*`` tensors (``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, ``norm``,
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

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.errors import ConfigError
from deepinfer.interfaces import ForwardContext
from deepinfer.kv.state import CompressedPart, HybridLayerSpec, RingPart
from deepinfer.model.base import StackedDecoderLM, config_value
from deepinfer.model.deepseek_v3 import FORCE_BALANCED_ROUTING_KEY, count_routed_tokens, expert_rows, in_main_layer
from deepinfer.model.layers.reference_deepseek_v4 import entry_rows, ring_rows
from deepinfer.model.layers.rope import inverse_frequencies
from deepinfer.model.transfer import to_device
from deepinfer.sampling.rng import splitmix64

logger = logging.getLogger(__name__)

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_SCORE_FNS = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
}


class V4Dims:
    """The shape, layer schedule and rope facts of a DeepSeek-V4 ``config.json`` (transformers' nested
    form or the upstream flat one: ``compress_ratios``, ``num_hash_layers``, ``rope_scaling``,
    ``qk_rope_head_dim``)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.hidden = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.layers = cfg["num_hidden_layers"]
        self.vocab = cfg["vocab_size"]
        self.head_dim = cfg.get("head_dim") or 512
        self.eps = config_value(cfg, "rms_norm_eps", default=1e-6)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.q_lora = cfg.get("q_lora_rank") or 1024
        partial = cfg.get("partial_rotary_factor")
        rope_dim = cfg.get("qk_rope_head_dim")
        self.rope_dim = int(rope_dim if rope_dim else self.head_dim * (partial if partial else 64 / 512))
        self.window = config_value(cfg, "sliding_window", default=128)
        self.o_groups = config_value(cfg, "o_groups", default=8)
        self.o_lora = config_value(cfg, "o_lora_rank", default=1024)
        self.index_heads = config_value(cfg, "index_n_heads", default=64)
        self.index_dim = config_value(cfg, "index_head_dim", default=128)
        self.index_topk = config_value(cfg, "index_topk", default=512)
        self.hc_mult = config_value(cfg, "hc_mult", default=4)
        self.hc_iters = config_value(cfg, "hc_sinkhorn_iters", default=20)
        self.hc_eps = config_value(cfg, "hc_eps", default=1e-6)
        self.n_routed = config_value(cfg, "n_routed_experts", "num_local_experts", default=256)
        self.n_shared = config_value(cfg, "n_shared_experts", default=1)
        self.top_k = config_value(cfg, "num_experts_per_tok", default=6)
        self.moe_inter = config_value(cfg, "moe_intermediate_size", "intermediate_size", default=2048)
        self.scaling = float(config_value(cfg, "routed_scaling_factor", default=1.5))
        self.swiglu_limit = cfg.get("swiglu_limit", 10.0)
        self.scoring = config_value(cfg, "scoring_func", default="sqrtsoftplus")
        self.num_mtp = config_value(cfg, "num_nextn_predict_layers", default=0)
        self.balanced = bool(cfg.get(FORCE_BALANCED_ROUTING_KEY, False))
        self.sharded, self.expert_ids = expert_rows(cfg, self.n_routed)
        rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
        if cfg.get("compress_rate_csa"):
            rates[CSA] = cfg["compress_rate_csa"]
        if cfg.get("compress_rate_hca"):
            rates[HCA] = cfg["compress_rate_hca"]
        self.rates = {SLIDING: 0, **rates}
        self.layer_types = self._layer_types(cfg)
        mlp = cfg.get("mlp_layer_types")
        if mlp is None:
            n_hash = config_value(cfg, "num_hash_layers", default=3)
            mlp = ["hash_moe"] * min(self.layers, n_hash) + ["moe"] * max(0, self.layers - n_hash)
        self.mlp_types = list(mlp)[: self.layers]
        self.rope_main, self.rope_compress = self._rope_sets(cfg)
        self.yoco = int(cfg.get("yoco_num_producer_layers") or 0)
        self._check(cfg)

    def _layer_types(self, cfg: dict[str, Any]) -> list[str]:
        if cfg.get("layer_types") is not None:
            return list(cfg["layer_types"])[: self.layers]
        if cfg.get("compress_ratios") is not None:
            # Upstream form: the ratio of each layer. 0 is sliding-only and the CSA rate is CSA; any
            # other ratio is HCA (transformers maps exactly 0/4/128; this also reads other HCA rates).
            types = []
            for r in list(cfg["compress_ratios"])[: self.layers]:
                if r and r != self.rates[CSA]:
                    self.rates[HCA] = r
                types.append(SLIDING if not r else CSA if r == self.rates[CSA] else HCA)
            if len({r for r in cfg["compress_ratios"][: self.layers] if r and r != self.rates[CSA]}) > 1:
                raise ConfigError("config.json compress_ratios: at most one heavily compressed ratio is supported")
            return types
        # transformers' default: two HCA layers, then CSA and HCA alternating.
        return [HCA] * min(self.layers, 2) + [CSA if i % 2 else HCA for i in range(max(self.layers - 2, 0))]

    def _rope_sets(self, cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        rp = dict(cfg.get("rope_parameters") or {})
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            return dict(rp["main"]), dict(rp["compress"])
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        for key, value in (cfg.get("rope_scaling") or {}).items():
            flat.setdefault("rope_type" if key == "type" else key, value)
        main = {"rope_type": "default", "rope_theta": config_value(cfg, "rope_theta", default=10000.0)}
        compress = {**flat, "rope_theta": config_value(cfg, "compress_rope_theta", default=160000.0)}
        compress.setdefault("rope_type", "default")
        if compress["rope_type"] == "yarn":
            # The V4 reference does not scale cos/sin by YaRN's mscale (transformers forces 1.0 too).
            compress.setdefault("attention_factor", 1.0)
        return main, compress

    def _check(self, cfg: dict[str, Any]) -> None:
        arch = "DeepseekV4ForCausalLM"
        if config_value(cfg, "hidden_act", default="silu") != "silu":
            raise ConfigError(f"config.json hidden_act must be 'silu' for {arch}")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ConfigError(f"config.json attention_bias/mlp_bias=true is not supported for {arch}")
        if cfg.get("num_key_value_heads", 1) != 1:
            raise ConfigError(f"config.json num_key_value_heads must be 1 for {arch} (one shared key=value head)")
        if len(self.layer_types) != self.layers or len(self.mlp_types) != self.layers:
            raise ConfigError(f"config.json layer_types and mlp_layer_types need num_hidden_layers={self.layers} "
                              "entries")
        unknown = sorted({t for t in self.layer_types if t not in (SLIDING, CSA, HCA)}
                         | {t for t in self.mlp_types if t not in ("moe", "hash_moe")})
        if unknown:
            raise ConfigError(f"config.json layer_types/mlp_layer_types: unknown entry {unknown[0]!r}")
        if self.scoring not in _SCORE_FNS:
            raise ConfigError(f"config.json scoring_func {self.scoring!r} is not supported for {arch} "
                              f"(supported: {', '.join(sorted(_SCORE_FNS))})")
        if (self.heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"config.json o_groups={self.o_groups} must divide num_attention_heads × head_dim")
        if not 0 < self.top_k <= self.n_routed:
            raise ConfigError(f"config.json num_experts_per_tok={self.top_k} must be in [1, n_routed_experts]")
        if self.yoco:
            consumers = self.layer_types[self.yoco:]
            if not 0 < self.yoco < self.layers or all(t == SLIDING for t in consumers):
                raise ConfigError(
                    f"config.json yoco_num_producer_layers={self.yoco} must be in (0, num_hidden_layers="
                    f"{self.layers}) with at least one compressed layer among the consumers (API.md §7)")

    def role(self, layer: int) -> str:
        if not self.yoco:
            return "plain"
        return "producer" if layer < self.yoco else "consumer"


# ---------------------------------------------------------------------------------------------- blocks


class V4RMSNorm(nn.Module):
    """RMSNorm whose scale stays float32: normalize and scale in float32, cast once (as V4 does)."""

    def __init__(self, dim: int, eps: float, device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last axis, the statistic in float32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4Rotary(nn.Module):
    """cos/sin tables ``[positions, rope/2]`` of one rope set, applied to the trailing ``rope_dim``
    channels as interleaved pairs ``(x0, x1), (x2, x3), …`` rotated in place."""

    def __init__(self, params: dict[str, Any], rope_dim: int, max_positions: int,
                 device: torch.device | None = None) -> None:
        super().__init__()
        inv_freq, factor = inverse_frequencies(params, rope_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.rope_dim = rope_dim
        self.register_buffer("cos", (freqs.cos() * factor).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * factor).to(device), persistent=False)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``x [T, ..., D]`` rotated by the angle of ``positions [T]`` (backwards with ``inverse``)."""
        shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        cos, sin = self.cos[positions].view(shape), self.sin[positions].view(shape)
        if inverse:
            sin = -sin
        nope, rope = x[..., : -self.rope_dim], x[..., -self.rope_dim:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
        return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


class HyperConnection(nn.Module):
    """One mHC site: from the streams, the sub-layer input and the (post, comb) weights of the write-back."""

    def __init__(self, d: V4Dims, device: torch.device | None = None) -> None:
        super().__init__()
        m = d.hc_mult
        self.m, self.iters, self.hc_eps, self.norm_eps = m, d.hc_iters, d.hc_eps, d.eps
        kw = {"dtype": torch.float32, "device": device}
        self.fn = nn.Parameter(torch.empty((2 + m) * m, m * d.hidden, **kw))
        self.base = nn.Parameter(torch.empty((2 + m) * m, **kw))
        self.scale = nn.Parameter(torch.empty(3, **kw))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, m, H]`` → ``post [T, m]``, ``comb [T, m, m]`` (float32), ``collapsed [T, H]``."""
        m = self.m
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mixes.split([m, m, m * m], dim=-1)
        pre_b, post_b, comb_b = self.base.split([m, m, m * m])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = (comb_w * self.scale[2] + comb_b).view(-1, m, m).softmax(dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)  # Sinkhorn: columns, then rounds
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def write_back(post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """``out[k] = post[k]·y + Σ_j comb[j, k]·streams[j]`` (comb is applied transposed)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * y.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(1, 2), streams)


class HyperHead(nn.Module):
    """The final fold of the streams into one hidden state."""

    def __init__(self, d: V4Dims, device: torch.device | None = None) -> None:
        super().__init__()
        m = d.hc_mult
        self.hc_eps, self.norm_eps = d.hc_eps, d.eps
        kw = {"dtype": torch.float32, "device": device}
        self.fn = nn.Parameter(torch.empty(m, m * d.hidden, **kw))
        self.base = nn.Parameter(torch.empty(m, **kw))
        self.scale = nn.Parameter(torch.empty(1, **kw))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn) * self.scale + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


@dataclass(frozen=True)
class _Segment:
    """One request's rows ``[lo, hi)`` of the step, computing positions ``[start, end)``."""

    lo: int
    hi: int
    start: int
    end: int
    slot: int
    floor: int
    index: int


def _segments(ctx: ForwardContext) -> list[_Segment]:
    if ctx.state_slots_host is None:
        raise RuntimeError("DeepseekV4ForCausalLM keeps per-request state: ctx.state_slots_host must be set "
                           "(the engine sets it for models whose cache specs have state slots)")
    starts, lens = ctx.query_start_loc_host, ctx.seq_lens_host
    floors = ctx.write_floor_host or [0] * len(lens)
    return [_Segment(starts[i], starts[i + 1], lens[i] - (starts[i + 1] - starts[i]), lens[i],
                     ctx.state_slots_host[i], floors[i], i) for i in range(len(lens))]


def device_rows(ctx: ForwardContext, max_query_len: int) -> bool:
    """Whether the compressors update on device tensors only (``Compressor._update_rows``): every request
    of the step brings at most ``max_query_len`` query tokens — as ``ctx.max_query_len`` states (a CUDA
    graph replay states its bucket's bound) or as decode rows do — and none rebuilds state below its
    write floor or is YoCo-truncated. Host values only; a graph replay's host lists are the capture's
    one-token requests, which pass (the runner replays no step that rebuilds state or truncates)."""
    if not (0 < ctx.max_query_len <= max_query_len or ctx.num_decodes == ctx.block_tables.shape[0]):
        return False
    if ctx.truncation_floor_host is not None:
        return False
    floors, starts = ctx.write_floor_host, ctx.query_start_loc_host
    return floors is None or all(f <= n - (starts[i + 1] - starts[i])
                                 for i, (f, n) in enumerate(zip(floors, ctx.seq_lens_host, strict=True)))


@dataclass(frozen=True)
class _DeviceRows:
    """A step's query tokens addressed on the device, for compressors that update without host lists
    (``device_rows``): ``requests [T]`` each token's request (its row of ``ctx.block_tables``) and
    ``slots [T]`` that request's state slot."""

    requests: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def of(cls, ctx: ForwardContext) -> _DeviceRows:
        """From ``query_start_loc`` on the device (requests without query tokens, such as those after a
        graph's padding, get none); in a step of decode rows token t is request t."""
        assert ctx.state_slots is not None, "a stateful step needs ctx.state_slots"
        dev, tokens = ctx.positions.device, ctx.positions.shape[0]
        if ctx.max_query_len == 1 or ctx.num_decodes == ctx.block_tables.shape[0]:
            return cls(torch.arange(tokens, device=dev), ctx.state_slots)
        starts = ctx.query_start_loc
        requests = torch.searchsorted(starts, torch.arange(tokens, dtype=starts.dtype, device=dev), right=True) - 1
        return cls(requests, ctx.state_slots.index_select(0, requests))


StepRows = Sequence[_Segment] | _DeviceRows
"""How a step's rows reach the compressors: per-request segments (host ints), or ``_DeviceRows``."""


@dataclass(frozen=True)
class _ConsumerView:
    """What the YoCo consumer layers compute under prefill truncation (reference/deepinfer.md §6): the
    step's ``ctx``, ``segments``, ``positions`` and ``input_ids`` restricted to ``rows`` (None: every row,
    mask mode), with each request's truncation floor as its visibility floor."""

    ctx: ForwardContext
    segments: list[_Segment]
    positions: torch.Tensor
    input_ids: torch.Tensor
    rows: torch.Tensor | None


def _consumer_view(ctx: ForwardContext, segments: Sequence[_Segment], input_ids: torch.Tensor) -> _ConsumerView:
    """The consumer layers' view of a step with ``ctx.truncation_floor_host`` set. A compact request keeps
    its rows from its floor on (a chunk wholly below it keeps its last row as a placeholder, whose window
    is then just itself); a mask request keeps every row."""
    assert ctx.truncation_floor_host is not None and ctx.truncation_compact_host is not None
    restore = ctx.visibility_floor_host or [0] * len(segments)
    floors = [max(a, b) for a, b in zip(restore, ctx.truncation_floor_host, strict=True)]
    dev = ctx.positions.device
    floor_tensor = to_device(floors, torch.int64, dev)
    if not any(ctx.truncation_compact_host):
        narrowed = replace(ctx, visibility_floor_host=floors, visibility_floor=floor_tensor)
        return _ConsumerView(narrowed, list(segments), ctx.positions, input_ids, None)
    kept: list[torch.Tensor] = []
    starts, compact = [0], []
    for s, floor, drop in zip(segments, floors, ctx.truncation_compact_host, strict=True):
        clip = min(max(floor - s.start, 0), s.hi - s.lo - 1) if drop else 0
        kept.append(torch.arange(s.lo + clip, s.hi, device=dev))
        compact.append(replace(s, lo=starts[-1], hi=starts[-1] + s.hi - s.lo - clip, start=s.start + clip))
        starts.append(compact[-1].hi)
    rows = torch.cat(kept)
    narrowed = replace(ctx, positions=ctx.positions[rows], slot_mapping=ctx.slot_mapping[rows],
                       query_start_loc=to_device(starts, ctx.query_start_loc.dtype, dev),
                       query_start_loc_host=starts, visibility_floor_host=floors, visibility_floor=floor_tensor)
    return _ConsumerView(narrowed, compact, narrowed.positions, input_ids[rows], rows)


class Compressor(nn.Module):
    """Pools ``ratio`` tokens into one entry of ``width`` (HCA: one series; CSA and the indexer:
    ``overlap``, two series over 2·ratio slots). Bound to a paged entry tensor and a ring of the raw
    per-token ``[kv, gate]`` projections (``bind``)."""

    def __init__(self, d: V4Dims, width: int, ratio: int, overlap: bool, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.width, self.ratio, self.overlap = width, ratio, overlap
        self.series = (2 if overlap else 1) * width
        self.kv_gate_weight = nn.Parameter(torch.empty(2 * self.series, d.hidden, dtype=dtype, device=device))
        self.position_bias = nn.Parameter(torch.empty(ratio, self.series, dtype=torch.float32, device=device))
        self.norm = V4RMSNorm(width, d.eps, device=device)
        self.paged: torch.Tensor | None = None
        self.ring: torch.Tensor | None = None

    def ring_span(self) -> int:
        """Positions an entry reads back: its window, and the previous one with overlap."""
        return (2 if self.overlap else 1) * self.ratio

    def update(self, x: torch.Tensor, ctx: ForwardContext, step_rows: StepRows, rotary: V4Rotary) -> None:
        """Project this step's rows of ``x [T, H]``, write every entry whose window closes in this step
        (unless below the request's write floor) and keep the projections in the ring: on device tensors
        only when ``step_rows`` are ``_DeviceRows`` (``_update_rows``), else request by request."""
        assert self.paged is not None and self.ring is not None, "compressor cache not bound"
        proj = ctx.backends["linear"].linear(x, self.kv_gate_weight)  # [T, 2 · series]: kv, then gate
        if isinstance(step_rows, _DeviceRows):
            self._update_rows(proj, ctx, step_rows, rotary)
            return
        size, r, dev = self.ring.shape[1], self.ratio, x.device
        per_block = self.paged.shape[1]
        flat = self.paged.view(-1, self.width)
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
                    flat.index_copy_(0, targets, entries[ids - w0])
            keep = min(s.hi - s.lo, size)
            self.ring[s.slot].index_copy_(0, ring_rows(s.end - keep, s.end, size, dev), proj[s.hi - keep:s.hi])

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
        ring = self.ring.view(-1, self.ring.shape[-1])
        pos, slots = ctx.positions, rows.slots
        ring.index_copy_(0, slots * size + pos % size, proj)
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
        flat = self.paged.view(-1, width)
        flat.index_copy_(0, targets, entries.to(flat.dtype))

    def _finish(self, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, rotary: V4Rotary) -> torch.Tensor:
        """Entries from their windows' ``kv`` and biased ``gate`` ``[entries, slots, width]``: softmax over
        the slots per channel, the weighted sum, the norm, then rope at ``positions`` (window starts)."""
        probs = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return rotary.rotate(self.norm((kv * probs).sum(dim=1)), positions)

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


class V4Attention(nn.Module):
    def __init__(self, d: V4Dims, kind: str, rotary: V4Rotary, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.d = d
        kw = {"dtype": dtype, "device": device}
        self.kind = kind
        self.ratio = int(d.rates[kind])
        self.rotary = rotary
        self.qkv_a_weight = nn.Parameter(torch.empty(d.q_lora + d.head_dim, d.hidden, **kw))
        self.q_a_norm = V4RMSNorm(d.q_lora, d.eps, device=device)
        self.q_b_weight = nn.Parameter(torch.empty(d.heads * d.head_dim, d.q_lora, **kw))
        self.kv_norm = V4RMSNorm(d.head_dim, d.eps, device=device)
        self.o_a_weight = nn.Parameter(torch.empty(d.o_groups * d.o_lora, d.heads * d.head_dim // d.o_groups, **kw))
        self.o_b_weight = nn.Parameter(torch.empty(d.hidden, d.o_groups * d.o_lora, **kw))
        self.sinks = nn.Parameter(torch.empty(d.heads, dtype=torch.float32, device=device))
        self.compressor = (Compressor(d, d.head_dim, self.ratio, overlap=self.kind == CSA, **kw)
                           if self.kind != SLIDING else None)
        self.indexer = Indexer(d, self.ratio, **kw) if self.kind == CSA else None
        self.scale = d.head_dim ** -0.5
        self.ring: torch.Tensor | None = None

    def cache_spec(self, role: str) -> HybridLayerSpec:
        d = self.d
        rings = [RingPart(d.window, d.head_dim)]
        paged = []
        for comp in (self.compressor, self.indexer.compressor if self.indexer else None):
            if comp is not None:
                paged.append(CompressedPart(comp.ratio, comp.width))
                rings.append(RingPart(comp.ring_span(), 2 * comp.series))
        kind = "sliding" if self.kind == SLIDING else "compressed"
        return HybridLayerSpec(tuple(paged), tuple(rings), kind, d.window, max(self.ratio, 1), role)

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


class V4MoE(nn.Module):
    def __init__(self, d: V4Dims, layer: int, mlp_type: str, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.d, self.layer = d, layer
        self.is_hash = mlp_type == "hash_moe"
        f32 = {"dtype": torch.float32, "device": device}
        kw = {"dtype": dtype, "device": device}
        e, inter = d.n_routed, d.moe_inter
        self.gate_weight = nn.Parameter(torch.empty(e, d.hidden, **f32))
        if self.is_hash:
            # Valid expert ids until the checkpoint's table is loaded (dummy weights keep them).
            tokens = torch.arange(d.vocab, device=device).unsqueeze(1) * 7919
            table = (tokens + torch.arange(d.top_k, device=device)) % e
            self.register_buffer("tid2eid", table, persistent=False)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(e, **f32), requires_grad=False)
        # Expert-parallel capable (``parallel/moe.py``), as V3's ``DeepseekMoE``: ``num_experts`` logical
        # experts, ``expert_ids`` the logical expert of each row of ``w13``/``w2``, and ``expert_parallel``
        # (set on a rank) replacing the ``experts`` op.
        self.num_experts = e
        self.expert_ids = d.expert_ids if layer < d.layers else list(range(e))
        self.w13 = nn.Parameter(torch.empty(len(self.expert_ids), 2 * inter, d.hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(len(self.expert_ids), d.hidden, inter, **kw))
        self.expert_parallel: Any = None
        shared = inter * d.n_shared
        self.shared_gate_up = nn.Parameter(torch.empty(2 * shared, d.hidden, **kw)) if shared else None
        self.shared_down = nn.Parameter(torch.empty(d.hidden, shared, **kw)) if shared else None
        self.stats: torch.Tensor | None = None

    def route(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [T, k] int64, weights [T, k] float32)``."""
        d = self.d
        scores = _SCORE_FNS[d.scoring](F.linear(x.float(), self.gate_weight))
        if self.is_hash:
            ids = self.tid2eid[input_ids]
        elif d.balanced:
            ids = self._balanced_ids(positions)
        else:
            ids = (scores + self.e_score_correction_bias).topk(d.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * d.scaling

    def _balanced_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """k distinct experts per token, uniformly at random from a hash of (position, layer, expert)."""
        experts = torch.arange(self.d.n_routed, device=positions.device)
        key = splitmix64(positions.to(torch.int64) * 65536 + self.layer)
        draws = splitmix64(key.unsqueeze(1) + experts) & ((1 << 62) - 1)
        return draws.topk(self.d.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        ids, weights = self.route(x, input_ids, positions)
        if self.stats is not None:
            count_routed_tokens(self.stats, ids, ctx)
        limit = self.d.swiglu_limit
        if self.expert_parallel is not None:
            out = self.expert_parallel(x, ids, weights, ctx, swiglu_limit=limit)
        else:
            out = ctx.backends["experts"].experts(x, ids, weights, (self.w13, self.w2), swiglu_limit=limit)
        if self.shared_gate_up is not None:
            gemm = ctx.backends["linear"]
            gate, up = gemm.linear(x, self.shared_gate_up).chunk(2, dim=-1)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            out = out + gemm.linear(F.silu(gate) * up, self.shared_down)
        return out


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


# ------------------------------------------------------------------------------------ checkpoint names

# Per-layer names (after ``layers.L.``) → (parameter, narrow) where narrow = (dim-0 offset part, parts).
_ATTN = {
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_weight",
    "attn.wo_b.weight": "self_attn.o_b_weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.indexer.wq_b.weight": "self_attn.indexer.q_b_weight",
    "attn.indexer.weights_proj.weight": "self_attn.indexer.weights_weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.gate.weight": "mlp.gate_weight",
    "ffn.gate.bias": "mlp.e_score_correction_bias",
}
_COMPRESSOR = {"ape": "position_bias", "norm.weight": "norm.weight"}
_SHARED = {"w1.weight": ("mlp.shared_gate_up", 0), "w3.weight": ("mlp.shared_gate_up", 1),
           "w2.weight": ("mlp.shared_down", None)}
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "e_proj.weight": "e_proj_weight",
        "h_proj.weight": "h_proj_weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.fn",
        "hc_head_base": "hc_head.base", "hc_head_scale": "hc_head.scale"}
_TOP = {"embed.weight": "embed_tokens.weight", "embed_tokens.weight": "embed_tokens.weight",
        "norm.weight": "norm.weight", "hc_head_fn": "hc_head.fn", "hc_head.hc_fn": "hc_head.fn",
        "hc_head_base": "hc_head.base", "hc_head.hc_base": "hc_head.base", "hc_head_scale": "hc_head.scale",
        "hc_head.hc_scale": "hc_head.scale"}


def _half(t: torch.Tensor, part: int) -> torch.Tensor:
    half = t.shape[0] // 2
    return t.narrow(0, part * half, half)


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
        # The loader's cue (``model/loader.py``): on an expert-parallel rank, read only these experts.
        self.expert_ids = d.expert_ids if d.sharded else None
        self.moe_layer_ids = list(range(d.layers))
        self.register_buffer("router_stats", torch.zeros(d.layers, d.n_routed, dtype=torch.int64, device=device),
                             persistent=False)
        for row, layer in enumerate(self.layers):
            layer.mlp.stats = self.router_stats[row]

    def _rotary(self, layer: int) -> V4Rotary:
        return self.rotary_main if self.d.layer_types[layer] == SLIDING else self.rotary_compress

    def capture_hidden(self, layer_ids: Sequence[int]) -> None:
        """Refused: V4's layers pass hyper-connection streams, not one residual row per token, so there
        is no single feature row to capture for a drafter (``dspark``). (Its own MTP layers' input is
        kept by ``bind_mtp_cache``.)"""
        raise ValueError("DeepSeek-V4 cannot capture layer features for a drafter (its layers pass "
                         "hyper-connection streams)")

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
        for i, layer in enumerate(self.layers):
            shares = bool(self.d.yoco) and i == self.d.yoco
            if shares and ctx.truncation_floor_host is not None:
                assert not isinstance(step_rows, _DeviceRows)  # device_rows refuses truncated steps
                view = _consumer_view(ctx, step_rows, input_ids)
            streams, shared = layer(streams, ctx.positions, input_ids, ctx, step_rows, shared, shares, view)
        hidden = self.norm(self.hc_head(streams))
        if self.captured_layers:  # the MTP layers' input (bind_mtp_cache)
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

    def _layer_target(self, rest: str, prefix: str, tensors: dict[str, torch.Tensor]
                      ) -> tuple[str, torch.Tensor] | None:
        """``(parameter or buffer name, the view to fill)`` for a per-layer checkpoint name ``rest``
        (after ``layers.L.``), the module's names starting with ``prefix``; None if it is not ours."""
        d = self.d

        def whole(name: str) -> tuple[str, torch.Tensor] | None:
            return (prefix + name, tensors[prefix + name]) if prefix + name in tensors else None

        def view(name: str, pick: Any) -> tuple[str, torch.Tensor] | None:
            found = whole(name)
            return None if found is None else (found[0], pick(found[1]))

        if rest in _ATTN:
            return whole(_ATTN[rest])
        if rest == "attn.wq_a.weight":
            return view("self_attn.qkv_a_weight", lambda t: t[: d.q_lora])
        if rest == "attn.wkv.weight":
            return view("self_attn.qkv_a_weight", lambda t: t[d.q_lora:])
        if rest == "ffn.gate.tid2eid":
            return whole("mlp.tid2eid")
        for owner, module in (("attn.indexer.compressor.", "self_attn.indexer.compressor."),
                              ("attn.compressor.", "self_attn.compressor.")):
            if rest.startswith(owner):
                leaf = rest[len(owner):]
                if leaf in ("wkv.weight", "wgate.weight"):
                    return view(module + "kv_gate_weight", lambda t, p=int(leaf == "wgate.weight"): _half(t, p))
                return whole(module + _COMPRESSOR[leaf]) if leaf in _COMPRESSOR else None
        if rest.startswith("ffn.shared_experts."):
            leaf = rest[len("ffn.shared_experts."):]
            if leaf not in _SHARED:
                return None
            name, part = _SHARED[leaf]
            return whole(name) if part is None else view(name, lambda t: _half(t, part))
        if rest.startswith("ffn.experts."):
            _, _, e, leaf = rest.split(".", 3)
            if leaf == "w2.weight":
                return view("mlp.w2", lambda t: t[int(e)])
            if leaf in ("w1.weight", "w3.weight"):
                return view("mlp.w13", lambda t: _half(t[int(e)], int(leaf == "w3.weight")))
            return None
        for site in ("attn", "ffn"):
            for leaf in ("fn", "base", "scale"):
                if rest == f"hc_{site}_{leaf}":
                    return whole(f"{site}_hc.{leaf}")
        return None

    @staticmethod
    def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
        return {**{n: p.data for n, p in module.named_parameters()}, **dict(module.named_buffers())}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Fill parameters from transformers' saved names or the upstream names; returns those filled."""
        tensors = self._tensors(self)
        filled: dict[str, int] = {}
        mtp_tensors: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name.startswith("mtp."):
                mtp_tensors.append((name, tensor))
                continue
            if name in ("head.weight", "lm_head.weight"):
                if self.lm_head is None:
                    continue
                dest: tuple[str, torch.Tensor] | None = ("lm_head", self.lm_head.data)
            elif name in _TOP:
                dest = (_TOP[name], tensors[_TOP[name]])
            elif name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                if int(idx) >= self.d.layers:
                    logger.info("%s: skipping %s (past num_hidden_layers)", self.architecture, name)
                    continue
                dest = self._layer_target(rest, f"layers.{idx}.", tensors)
            else:
                dest = None
            if dest is None:
                raise ValueError(f"weight {name!r} does not belong to {self.architecture}")
            _copy(name, dest, tensor, filled)
        tables = [f"layers.{i}.mlp.tid2eid" for i, t in enumerate(self.d.mlp_types) if t == "hash_moe"]
        missing_tables = [t for t in tables if t not in filled]
        if missing_tables:
            raise ValueError(f"checkpoint has no ffn.gate.tid2eid for {', '.join(missing_tables)}")
        params = dict(self.named_parameters())
        loaded = {n for n, count in filled.items() if n in params and count >= params[n].numel()}
        if mtp_tensors:
            loaded |= self._load_mtp(mtp_tensors)
        return loaded

    def _load_mtp(self, tensors: list[tuple[str, torch.Tensor]]) -> set[str]:
        """Build ``mtp_layers`` from upstream ``mtp.{k}.*`` tensors; a depth with tensors that do not fit,
        or with parameters left unfilled, is dropped with a warning."""
        d = self.d
        by_depth: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in tensors:
            _, k, rest = name.split(".", 2)
            by_depth.setdefault(int(k), []).append((rest, tensor))
        loaded: set[str] = set()
        for k in sorted(by_depth):
            if k != len(self.mtp_layers):
                logger.warning("%s: MTP depth %d skipped (depths must be consecutive from 0)", self.architecture, k)
                continue
            layer = V4MTPLayer(d, self.rotary_main, self._dtype, self._device)
            targets = self._tensors(layer)
            filled: dict[str, int] = {}
            problem = None
            for rest, tensor in by_depth[k]:
                if rest in ("emb.tok_emb.weight", "head.weight", "embed.weight"):
                    continue  # copies of the main model's embedding / head
                dest = ((_MTP[rest], targets[_MTP[rest]]) if rest in _MTP
                        else self._layer_target(rest, "block.", targets))
                if dest is None or dest[1].shape != tensor.shape:
                    problem = rest
                    break
                _copy(rest, dest, tensor, filled)
            params = dict(layer.named_parameters())
            missing = [n for n, p in params.items() if filled.get(n, 0) < p.numel()]
            if problem or missing:
                why = (f"unexpected tensor {problem!r}" if problem
                       else f"{len(missing)} tensors missing, e.g. {missing[0]}")
                logger.warning("%s: MTP depth %d not loaded (%s)", self.architecture, k, why)
                continue
            self.mtp_layers.append(layer)
            loaded |= {f"mtp_layers.{k}.{n}" for n in params}
        return loaded


def _all_rows(rows: torch.Tensor, num_tokens: int, view: _ConsumerView | None) -> torch.Tensor:
    """``rows`` of the step's tokens; under compact YoCo truncation only ``view.rows`` were computed and
    the others come back as zeros (never sampled, and below every later query's window)."""
    if view is None or view.rows is None:
        return rows
    return rows.new_zeros(num_tokens, rows.shape[1]).index_copy_(0, view.rows, rows)


def _copy(name: str, dest: tuple[str, torch.Tensor], tensor: torch.Tensor, filled: dict[str, int]) -> None:
    """Copy a checkpoint tensor into its destination view and count the elements filled per parameter."""
    owner, target = dest
    if target.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)
    filled[owner] = filled.get(owner, 0) + target.numel()
