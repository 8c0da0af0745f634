"""DeepSeek-V2/V3 decoders: ``DeepseekV3ForCausalLM`` and ``DeepseekV2ForCausalLM``.

Attention is MLA (multi-head latent attention). The cache holds only, per token, the compressed
latent (``kv_lora_rank``, after ``kv_a_layernorm``) and the shared rope key (``qk_rope_head_dim``,
rotated): a ``PagedLatentSpec`` row. The backend op ``mla_attention`` expands keys and values through
``kv_b_proj`` for prefill and uses the weight-absorbed form for decode
(``model/layers/reference_deepseek.py``). ``q_a_proj`` (or ``q_proj`` without ``q_lora_rank``) and
``kv_a_proj_with_mqa`` both read the hidden state and are stored fused as one GEMM.

Rope: only the ``qk_rope_head_dim`` slice is rotated. With ``rope_interleave`` (V3's default, and
always for V2) the pairs are ``(x0, x1), (x2, x3), …``; the rotated halves are written out
de-interleaved (``[even', odd']``), which is what V3 does; V2 writes them back interleaved, but q and
k are permuted alike so every dot product, hence the output, is the same. YaRN (with mscale) and the
other rope types come from ``layers/rope.py``; the softmax scale is ``qk_head_dim**-0.5`` times
``mscale(factor, mscale_all_dim)**2`` for a scaled rope (``layers/yarn.py``). ``q_a_layernorm`` and
``kv_a_layernorm`` use eps 1e-6 whatever ``rms_norm_eps`` says, as transformers does.

MoE (layers ``>= first_k_dense_replace``): routed experts through the backend op ``experts`` (stacked
``w13 [E, 2I, H]``, gate rows then up rows, and ``w2 [E, H, I]``) plus the shared experts (one fused
MLP of width ``moe_intermediate_size · n_shared_experts``). The router runs in float32 (its weight and
``e_score_correction_bias`` are float32 parameters whatever the model dtype).

- V3 (``noaux_tc``, always, as transformers does): sigmoid scores; the correction bias is added for
  the *choice* only; a group's score is the sum of its top-2 biased scores; the ``topk_group`` best
  groups are kept; top-k on the biased scores of the kept groups; weights are the un-biased scores,
  divided by their sum (+1e-20) if ``norm_topk_prob``, times ``routed_scaling_factor``.
- V2 (softmax scores): ``topk_method`` ``greedy`` (plain top-k) or ``group_limited_greedy`` (group
  score = max, other groups' scores set to 0); weights times ``routed_scaling_factor``, never
  normalized (transformers' DeepseekV2 ignores ``norm_topk_prob``, and so do we).

Balanced routing for benchmarks: when ``hf_config["deepinfer_force_balanced_routing"]`` is true (the
engine sets it from ``kernels.force_balanced_routing``), each token's k experts are instead drawn
uniformly at random, without repetition, from a counter-based hash (SplitMix64) of (position, layer,
expert), so the draw does not depend on the batch; the weights are still the router's scores of the
chosen experts (normalized and scaled as above).

Weights load under the names transformers saves (per-expert ``mlp.experts.{e}.{gate,up,down}_proj``;
the fused in-memory ``mlp.experts.gate_up_proj``/``down_proj`` are accepted too). FP8 checkpoints
(``X.weight`` in e4m3 with ``X.weight_scale_inv`` per ``quantization_config.weight_block_size`` tile)
are dequantized at load (``dequantize_fp8_checkpoint``); an FP8 MoE backend re-quantizes the experts
in its ``prepare_experts`` with the same tiles, which gives back the checkpoint's FP8 values.
The MoE backend's optional ``prepare_experts`` runs once per layer (``prepare_experts(backend)`` at load,
or on the layer's first forward); its result is what the ``experts`` op reads.

Router statistics: ``model.router_stats`` is an int64 ``[num MoE layers, n_routed_experts]`` buffer on
the model's device; every MoE forward of the main layers adds its tokens per chosen expert with
``index_add_`` (``count_routed_tokens``: no host sync; a CUDA graph's padding rows, past
``ForwardContext.num_real_tokens``, are not counted). ``take_router_stats()`` returns the counts so far
and zeroes the buffer; the engine core calls it once per step for ``StepStats.router_loads`` when a
``deepinfer_step_end`` observer is registered. ``moe_layer_ids`` maps rows to decoder layer indices.
The MTP layers' MoE is deliberately not counted: its experts are separate weights that expert
parallelism does not place (``parallel.moe.ep_capable_layers`` leaves them out, every rank keeps them
whole), so their loads mean nothing to the expert-placement balancer that reads these counts.

Expert shards: inside an expert-parallel rank the engine passes ``deepinfer_expert_shard`` (a
``parallel.placement.ExpertShard``); the main layers' MoE modules then allocate only the rows of the
experts the shard names (``expert_ids``, the same for every layer; the MTP layers keep every expert),
and the loader reads only those experts' tensors, renamed to their rows (``model/loader.py``;
``shards_weight`` tells it which tensors the shard covers). A rank without the ``mtp`` drafter reads no
MTP tensor (``mtp_weight`` names them), so it builds no MTP layer.

MTP (multi-token prediction, ``num_nextn_predict_layers``): checkpoints that carry
``model.layers.{N}.*`` for ``N`` in ``[num_hidden_layers, num_hidden_layers + num_nextn_predict_layers)``
(``enorm``, ``hnorm``, ``eh_proj``, a full decoder block with its MoE, ``shared_head.norm``; the
``shared_head.head``/``embed_tokens`` copies are skipped, the main model's are shared) load into
``model.mtp_layers`` (an ``nn.ModuleList``, empty when the checkpoint has no MTP weights; an incomplete
MTP layer is dropped with a warning). transformers' ``MtpModel`` calls ``shared_head.norm``
``post_norm``. For drafters:

- ``mtp_forward(hidden [T, H], next_token_ids [T], positions [T], ctx, depth=0) -> logits [T, V]``
  (float32). Row t takes the main model's output ``hidden[t]`` (after the final norm: what
  ``forward`` returns) for the token at ``positions[t]`` and the *next* token's id, and predicts the
  token after that: ``eh_proj(cat(enorm(embed(next)), hnorm(hidden)))`` → decoder block →
  ``shared_head.norm`` → LM head. ``mtp_hidden`` returns that normed hidden (the input of depth + 1),
  ``mtp_logits`` the LM head's logits of such rows.
- The MTP block attends over its own latent cache, which shares the main model's paging: the same
  ``ctx`` (slot mapping, block tables, lengths) and ``positions = ctx.positions``, so the MTP row of
  the token at position p lives in the slot of p. ``mtp_cache_specs()`` gives one ``PagedLatentSpec``
  per loaded MTP layer and ``bind_mtp_cache`` binds tensors allocated with the main pool's
  ``num_blocks``/``block_size``. These are *not* part of ``cache_specs()`` (a model without a drafter
  should not pay for them): when the drafter is ``mtp`` the engine allocates them in the main pool,
  after the weights loaded, and the drafter runs ``mtp_hidden`` on every token the main model
  computes (prefill included, shifted ids: the last row takes the token just sampled; the core's
  ``CommittedRows``), so that every visible row of the MTP cache is written. Rolling back drafts
  needs nothing: rows past ``num_computed`` are never read and are overwritten.
  ``build_mtp_layers()`` creates the layers without weights (for ``load_format=dummy``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.errors import ConfigError
from deepinfer.interfaces import ForwardContext, RoutingSpec
from deepinfer.kv.specs import PagedLatentSpec
from deepinfer.model.base import StackedDecoderLM, config_value
from deepinfer.model.layers import routing
from deepinfer.model.layers.norm import RMSNorm
from deepinfer.model.layers.rope import inverse_frequencies, rope_parameters
from deepinfer.model.layers.yarn import yarn_softmax_scale

logger = logging.getLogger(__name__)

FORCE_BALANCED_ROUTING_KEY = "deepinfer_force_balanced_routing"
EXPERT_SHARD_KEY = "deepinfer_expert_shard"  # an ExpertShard (or None) set by the engine inside a rank
_LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps


class _Dims:
    """The shape and routing facts of a DeepSeek-V2/V3 config."""

    def __init__(self, hf_config: dict[str, Any], arch: str) -> None:
        self.v3 = arch == "DeepseekV3ForCausalLM"
        self.hidden = hf_config["hidden_size"]
        self.heads = hf_config["num_attention_heads"]
        self.layers = hf_config["num_hidden_layers"]
        self.vocab = hf_config["vocab_size"]
        self.eps = config_value(hf_config, "rms_norm_eps", default=1e-6)
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        self.q_lora = hf_config.get("q_lora_rank")
        self.kv_lora = hf_config["kv_lora_rank"]
        self.nope = hf_config["qk_nope_head_dim"]
        self.rope = hf_config["qk_rope_head_dim"]
        self.v_dim = hf_config["v_head_dim"]
        self.qk_head = self.nope + self.rope
        self.intermediate = hf_config["intermediate_size"]
        self.moe_intermediate = hf_config.get("moe_intermediate_size")
        self.n_routed = config_value(hf_config, "n_routed_experts", "num_local_experts", "num_experts", default=0)
        self.n_shared = hf_config.get("n_shared_experts") or 0
        self.top_k = hf_config.get("num_experts_per_tok") or 0
        self.n_group = hf_config.get("n_group") or 1
        self.topk_group = hf_config.get("topk_group") or 1
        self.first_dense = hf_config.get("first_k_dense_replace") or 0
        self.scaling = float(config_value(hf_config, "routed_scaling_factor", default=2.5 if self.v3 else 1.0))
        self.norm_topk = bool(config_value(hf_config, "norm_topk_prob", default=True)) if self.v3 else False
        self.topk_method = "noaux_tc" if self.v3 else (hf_config.get("topk_method") or "greedy")
        self.interleave = bool(config_value(hf_config, "rope_interleave", default=True)) if self.v3 else True
        self.balanced = bool(hf_config.get(FORCE_BALANCED_ROUTING_KEY, False))
        self.sharded, self.expert_ids = expert_rows(hf_config, self.n_routed)
        self.rope_params = rope_parameters(hf_config)
        self.num_mtp = config_value(hf_config, "num_nextn_predict_layers", "num_mtp_layers", default=0)
        quant = hf_config.get("quantization_config") or {}
        self.fp8_block = tuple(quant.get("weight_block_size") or (128, 128))  # FP8 checkpoints' scale tiles
        if config_value(hf_config, "hidden_act", default="silu") != "silu":
            raise ConfigError(f"config.json hidden_act must be 'silu' for {arch}")
        if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):
            raise ConfigError(f"config.json attention_bias/mlp_bias=true is not supported for {arch}")
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ConfigError(f"config.json topk_method {self.topk_method!r} is not supported for {arch} "
                              "(supported: greedy, group_limited_greedy)")
        if self.n_routed and (self.n_routed % self.n_group or not 0 < self.top_k <= self.n_routed):
            raise ConfigError(f"config.json: n_routed_experts={self.n_routed} must split into n_group="
                              f"{self.n_group} groups and hold num_experts_per_tok={self.top_k}")

    def is_moe(self, layer: int) -> bool:
        return bool(self.n_routed) and layer >= self.first_dense


def dequantize_fp8_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], block: Sequence[int]
                              ) -> Iterable[tuple[str, torch.Tensor]]:
    """FP8 checkpoints (DeepSeek-V3's ``quant_method: fp8``) store a linear weight ``X.weight`` in
    float8_e4m3fn next to ``X.weight_scale_inv`` (float32, one dequantization multiplier per
    ``block = (rows, cols)`` tile, partial tiles at the edges). Yield each such pair as one float32
    ``X.weight``; other tensors pass through. The halves may come in any order."""
    rows, cols = block
    weights_fp8: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}

    def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        full = scale.float().repeat_interleave(rows, 0)[: q.shape[0]].repeat_interleave(cols, 1)[:, : q.shape[1]]
        return q.float() * full

    for name, tensor in weights:
        if name.endswith(".weight_scale_inv"):
            base = name.removesuffix("_scale_inv")
            if base in weights_fp8:
                yield base, dequantize(weights_fp8.pop(base), tensor)
            else:
                scales[base] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in scales:
                yield name, dequantize(tensor, scales.pop(name))
            else:
                weights_fp8[name] = tensor
        else:
            yield name, tensor
    unpaired = sorted(weights_fp8) + sorted(n + "_scale_inv" for n in scales)
    if unpaired:
        raise ValueError(f"FP8 checkpoint: {len(unpaired)} tensors lack their weight/weight_scale_inv partner, "
                         f"e.g. {unpaired[0]!r}")


class MLARotary(nn.Module):
    """cos/sin tables ``[positions, rope/2]`` (times the rope's attention factor) for the rope slice."""

    def __init__(self, d: _Dims, max_positions: int, device: torch.device | None = None) -> None:
        super().__init__()
        inv_freq, factor = inverse_frequencies(d.rope_params, d.rope)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.interleave = d.interleave
        self.register_buffer("cos", (freqs.cos() * factor).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * factor).to(device), persistent=False)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [..., R]``; pairs are ``(x[2i], x[2i+1])`` when interleaved, else
        ``(x[i], x[i+R/2])``; the result is always in the half-split layout."""
        x32 = x.float()
        if self.interleave:
            x1, x2 = x32[..., 0::2], x32[..., 1::2]
        else:
            x1, x2 = x32.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos[positions], self.sin[positions]  # [T, R/2]
        return self.rotate(q_pe, cos.unsqueeze(1), sin.unsqueeze(1)), self.rotate(k_pe, cos, sin)


class MLAttention(nn.Module):
    def __init__(self, d: _Dims, rotary: MLARotary, **kw: Any) -> None:
        super().__init__()
        self.d = d
        self.q_out = d.q_lora if d.q_lora else d.heads * d.qk_head
        self.qkv_a_weight = nn.Parameter(torch.empty(self.q_out + d.kv_lora + d.rope, d.hidden, **kw))
        if d.q_lora:
            self.q_a_layernorm = RMSNorm(d.q_lora, _LATENT_NORM_EPS, **kw)
            self.q_b_weight = nn.Parameter(torch.empty(d.heads * d.qk_head, d.q_lora, **kw))
        self.kv_a_layernorm = RMSNorm(d.kv_lora, _LATENT_NORM_EPS, **kw)
        self.kv_b_weight = nn.Parameter(torch.empty(d.heads * (d.nope + d.v_dim), d.kv_lora, **kw))
        self.o_weight = nn.Parameter(torch.empty(d.hidden, d.heads * d.v_dim, **kw))
        self.rotary = rotary
        self.scale = yarn_softmax_scale(d.rope_params, d.qk_head)
        self.kv_cache: tuple[torch.Tensor, ...] = ()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        d, gemm = self.d, ctx.backends["linear"]
        q, latent, k_pe = gemm.linear(x, self.qkv_a_weight).split([self.q_out, d.kv_lora, d.rope], dim=-1)
        if d.q_lora:
            q = gemm.linear(self.q_a_layernorm(q), self.q_b_weight)
        q_nope, q_pe = q.reshape(-1, d.heads, d.qk_head).split([d.nope, d.rope], dim=-1)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        out = ctx.backends["mla_attention"].mla_attention(
            q_nope, q_pe, self.kv_a_layernorm(latent), k_pe, self.kv_cache, ctx,
            kv_b_weight=self.kv_b_weight, scale=self.scale)
        return gemm.linear(out.reshape(-1, d.heads * d.v_dim), self.o_weight)


class DenseMLP(nn.Module):
    """SwiGLU with gate and up fused into one GEMM."""

    def __init__(self, hidden: int, intermediate: int, **kw: Any) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_weight = nn.Parameter(torch.empty(2 * intermediate, hidden, **kw))
        self.down_weight = nn.Parameter(torch.empty(hidden, intermediate, **kw))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gemm = ctx.backends["linear"]
        gate, up = gemm.linear(x, self.gate_up_weight).split(self.intermediate, dim=-1)
        return gemm.linear(F.silu(gate) * up, self.down_weight)


def expert_rows(hf_config: dict[str, Any], n_routed: int) -> tuple[bool, list[int]]:
    """Whether the engine gave the model an expert shard (``EXPERT_SHARD_KEY``), and the logical expert
    of each row of the main layers' expert stacks: the shard's, or every expert in order (the MTP
    layers keep every expert: drafting runs them locally)."""
    shard = hf_config.get(EXPERT_SHARD_KEY)
    if shard is None or n_routed == 0:
        return False, list(range(n_routed))
    return True, shard.experts(n_routed)


def layer_index(name: str) -> int | None:
    """The decoder layer ``L`` of checkpoint tensor ``name`` (``[model.]layers.L.…``), else None."""
    parts = name.removeprefix("model.").split(".", 2)
    return int(parts[1]) if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() else None


def in_main_layer(name: str, num_layers: int) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a main decoder layer (L < ``num_layers``; not an MTP
    layer): the tensors an expert shard covers (``shards_weight``)."""
    layer = layer_index(name)
    return layer is not None and layer < num_layers


def count_routed_tokens(stats: torch.Tensor, ids: torch.Tensor, ctx: ForwardContext) -> None:
    """Add the experts each row chose (``ids [T, k]``) to ``stats [n_routed]`` (int64), in place and
    without a host sync. Under a CUDA graph's replay only the first ``ctx.num_real_tokens`` rows count:
    the rest pad the step to its bucket (``engine/graphs.py``)."""
    flat = ids.reshape(-1)
    if ctx.num_real_tokens is None:
        weights = torch.ones_like(flat)
    else:
        real = torch.arange(ids.shape[0], device=ids.device) < ctx.num_real_tokens
        weights = real.to(torch.int64).unsqueeze(1).expand_as(ids).reshape(-1)
    if torch.compiler.is_compiling():
        # Inductor lowers an int64 ``index_add_`` to aten's sort-based accumulation (on CUDA a radix sort and
        # ~10 small kernels per layer); a one-hot sum over the pairs is one fused reduction.
        experts = torch.arange(stats.shape[0], device=ids.device)
        stats.add_(((flat.unsqueeze(1) == experts) * weights.unsqueeze(1)).sum(dim=0))
        return
    stats.index_add_(0, flat, weights)


class DeepseekMoE(nn.Module):
    def __init__(self, d: _Dims, layer: int, **kw: Any) -> None:
        super().__init__()
        self.d, self.layer = d, layer
        dev = kw["device"]
        experts, inter = d.n_routed, d.moe_intermediate
        self.gate_weight = nn.Parameter(torch.empty(experts, d.hidden, dtype=torch.float32, device=dev))
        if d.v3:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32, device=dev),
                                                        requires_grad=False)
        # Expert-parallel capable (``parallel/moe.py``): ``num_experts`` logical experts, and the logical
        # expert of each row of ``w13``/``w2`` (every expert in order, or this rank's shard).
        self.num_experts = experts
        self.expert_ids = d.expert_ids if layer < d.layers else list(range(experts))
        self.w13 = nn.Parameter(torch.empty(len(self.expert_ids), 2 * inter, d.hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(len(self.expert_ids), d.hidden, inter, **kw))
        self.shared_experts = DenseMLP(d.hidden, inter * d.n_shared, **kw) if d.n_shared else None
        # Row of the model's ``router_stats`` ``[n_routed]`` this layer counts into (None: not counted).
        self.stats: torch.Tensor | None = None
        # Set by ``deepinfer.parallel.moe.attach_expert_parallel`` on a rank of an expert-parallel group:
        # it holds this rank's expert slots and replaces the ``experts`` op with dispatch/compute/combine.
        self.expert_parallel: Any = None
        # What the MoE backend's optional ``prepare_experts`` made of (w13, w2), and for which backend.
        self._prepared: Any = None
        self._prepared_for: Any = None
        method = "balanced" if d.balanced else d.topk_method
        self.routing = RoutingSpec(top_k=d.top_k, scoring="sigmoid" if d.v3 else "softmax", method=method,
                                   n_group=d.n_group, topk_group=d.topk_group, normalize=d.norm_topk,
                                   scaling=d.scaling, layer=layer)

    def route(self, x: torch.Tensor, positions: torch.Tensor, gemm: Any = None,
              experts: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids [T, k] int64, topk_weights [T, k] float32)``: the gate GEMM, then the MoE backend
        ``experts``'s fused ``select_experts`` when it has one that serves this spec, else the reference
        (``layers/routing.py``; under balanced routing the router's own choice is never computed)."""
        # Through the ``linear`` op when given (the forward passes it), so batch-invariant mode covers the gate.
        logits = F.linear(x.float(), self.gate_weight) if gemm is None else gemm.linear(x.float(), self.gate_weight)
        bias = self.e_score_correction_bias if self.d.v3 else None
        select = getattr(experts, "select_experts", None)
        if select is not None:
            routed = select(logits, bias, positions, self.routing)
            if routed is not None:
                return routed
        return routing.route(logits, bias, positions, self.routing)

    def expert_weights(self, backend: Any) -> Any:
        """The ``weights`` argument of ``backend.experts``: ``(w13, w2)``, or what the backend's optional
        ``prepare_experts(w13, w2)`` (``MoEBackend``) returned — prepared once per backend, on the first
        forward unless ``DeepseekV3ForCausalLM.prepare_experts`` ran at load."""
        if self._prepared_for is not backend:
            prepare = getattr(backend, "prepare_experts", None)
            self._prepared = (self.w13, self.w2) if prepare is None else prepare(self.w13, self.w2)
            self._prepared_for = backend
        return self._prepared

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ids, weights = self.route(x, positions, ctx.backends["linear"], ctx.backends["experts"])
        if self.stats is not None:
            count_routed_tokens(self.stats, ids, ctx)
        if self.expert_parallel is not None:
            out = self.expert_parallel(x, ids, weights, ctx)
        else:
            backend = ctx.backends["experts"]
            out = backend.experts(x, ids, weights, self.expert_weights(backend))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, ctx)
        return out


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, d: _Dims, layer: int, rotary: MLARotary, **kw: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden, d.eps, **kw)
        self.self_attn = MLAttention(d, rotary, **kw)
        self.post_attention_layernorm = RMSNorm(d.hidden, d.eps, **kw)
        self.is_moe = d.is_moe(layer)
        self.mlp = DeepseekMoE(d, layer, **kw) if self.is_moe else DenseMLP(d.hidden, d.intermediate, **kw)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, positions, ctx) if self.is_moe else self.mlp(h, ctx))


class DeepseekMTPLayer(nn.Module):
    """One MTP depth: ``eh_proj(cat(enorm(embedding), hnorm(hidden)))`` → decoder block → ``shared_head_norm``."""

    def __init__(self, d: _Dims, layer: int, rotary: MLARotary, **kw: Any) -> None:
        super().__init__()
        self.enorm = RMSNorm(d.hidden, d.eps, **kw)
        self.hnorm = RMSNorm(d.hidden, d.eps, **kw)
        self.eh_proj_weight = nn.Parameter(torch.empty(d.hidden, 2 * d.hidden, **kw))
        self.block = DeepseekDecoderLayer(d, layer, rotary, **kw)
        self.shared_head_norm = RMSNorm(d.hidden, d.eps, **kw)

    def forward(self, positions: torch.Tensor, embedded: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x = ctx.backends["linear"].linear(x, self.eh_proj_weight)
        return self.shared_head_norm(self.block(positions, x, ctx))


# MTP tensor names (after ``model.layers.{N}.``) that are not part of the decoder block.
_MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
              "eh_proj.weight": "eh_proj_weight", "shared_head.norm.weight": "shared_head_norm.weight"}
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # copies of the main model's

_MLP_NAMES = {"gate_proj.weight": ("gate_up_weight", 0), "up_proj.weight": ("gate_up_weight", 1),
              "down_proj.weight": ("down_weight", None)}


class DeepseekV3ForCausalLM(StackedDecoderLM):
    """DeepSeek-V3 (and, as a subclass, V2): MLA over the paged latent cache, MoE with shared experts."""

    architecture = "DeepseekV3ForCausalLM"
    # The backend ops this model calls on one rank (``dispatch``/``combine`` only under expert parallelism).
    backend_ops = frozenset({"linear", "mla_attention", "experts"})

    def __init__(self, hf_config: dict[str, Any], *, dtype: torch.dtype, device: torch.device,
                 max_positions: int) -> None:
        super().__init__()
        self.d = d = _Dims(hf_config, self.architecture)
        kw = {"dtype": dtype, "device": device}
        self.vocab_size = d.vocab
        self.embed_tokens = nn.Embedding(d.vocab, d.hidden, **kw)
        rotary = MLARotary(d, max_positions, device=device)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(d, i, rotary, **kw) for i in range(d.layers))
        self.norm = RMSNorm(d.hidden, d.eps, **kw)
        self.lm_head = None if d.tied else nn.Parameter(torch.empty(d.vocab, d.hidden, **kw))
        self._rotary, self._kw = rotary, kw
        self.mtp_layers = nn.ModuleList()  # filled by load_weights when the checkpoint has MTP weights
        # The loader's cue (``model/loader.py``): on an expert-parallel rank, read only these experts.
        self.expert_ids = d.expert_ids if d.sharded else None
        moe = [layer.mlp for layer in self.layers if layer.is_moe]
        self.moe_layer_ids = [i for i, layer in enumerate(self.layers) if layer.is_moe]
        self.register_buffer("router_stats", torch.zeros(len(moe), d.n_routed, dtype=torch.int64, device=device),
                             persistent=False)
        for row, mlp in enumerate(moe):
            mlp.stats = self.router_stats[row]

    def prepare_experts(self, backend: Any) -> None:
        """Prepare every MoE layer's expert weights for ``backend`` now (``MoEBackend.prepare_experts``):
        call it once the weights are final, and again after they change (a prepared copy, e.g. FP8,
        does not follow later writes to ``w13``/``w2``)."""
        for module in self.modules():
            if isinstance(module, DeepseekMoE):
                module._prepared_for = None
                module.expert_weights(backend)

    def shards_weight(self, name: str) -> bool:
        """Whether the expert shard covers checkpoint tensor ``name``'s routed experts (``model/loader.py``)."""
        return in_main_layer(name, self.d.layers)

    def mtp_weight(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to an MTP layer (``[model.]layers.L.…``, L at or past
        ``num_hidden_layers``)."""
        layer = layer_index(name)
        return layer is not None and layer >= self.d.layers

    def take_router_stats(self) -> torch.Tensor:
        """Tokens routed to each expert ``[num MoE layers, n_routed]`` (int64, on the model's device)
        since the last call, and zero the buffer. No host sync."""
        out = self.router_stats.clone()
        self.router_stats.zero_()
        return out

    def cache_specs(self) -> Sequence[PagedLatentSpec]:
        return [PagedLatentSpec(self.d.kv_lora, self.d.rope) for _ in range(self.d.layers)]

    def bind_cache(self, caches: Sequence[tuple[torch.Tensor, ...]]) -> None:
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.kv_cache = cache

    def mtp_cache_specs(self) -> Sequence[PagedLatentSpec]:
        """One latent cache per loaded MTP layer (empty without MTP weights); not in ``cache_specs``."""
        return [PagedLatentSpec(self.d.kv_lora, self.d.rope) for _ in self.mtp_layers]

    def bind_mtp_cache(self, caches: Sequence[tuple[torch.Tensor, ...]]) -> None:
        for layer, cache in zip(self.mtp_layers, caches, strict=True):
            layer.block.self_attn.kv_cache = cache

    def mtp_hidden(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor,
                   ctx: ForwardContext, depth: int = 0) -> torch.Tensor:
        """The normed output ``[T, H]`` of MTP layer ``depth`` (see the module docstring)."""
        return self.mtp_layers[depth](positions, self.embed_tokens(next_token_ids), hidden, ctx)

    def mtp_logits(self, hidden: torch.Tensor, ctx: ForwardContext, depth: int = 0) -> torch.Tensor:
        """Float32 logits ``[T, V]`` of ``mtp_hidden``'s output (the shared LM head: already normed)."""
        return self.compute_logits(hidden, ctx)

    def mtp_forward(self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor,
                    ctx: ForwardContext, depth: int = 0) -> torch.Tensor:
        """Float32 logits ``[T, V]`` of MTP layer ``depth`` for the token after ``next_token_ids``."""
        return self.mtp_logits(self.mtp_hidden(hidden, next_token_ids, positions, ctx, depth), ctx, depth)

    def gemm_weights(self) -> list[nn.Parameter]:
        """Linear weights for the GEMM backend. ``kv_b_weight`` is not listed (the MLA backend reads
        it per head), nor the experts (the MoE backend) or the float32 router."""
        out: list[nn.Parameter] = [mtp.eh_proj_weight for mtp in self.mtp_layers]
        for layer in [*self.layers, *(mtp.block for mtp in self.mtp_layers)]:
            attn = layer.self_attn
            out += [attn.qkv_a_weight, attn.o_weight] + ([attn.q_b_weight] if self.d.q_lora else [])
            mlp = layer.mlp.shared_experts if layer.is_moe else layer.mlp
            if mlp is not None:
                out += [mlp.gate_up_weight, mlp.down_weight]
        return [*out, self.embed_tokens.weight if self.lm_head is None else self.lm_head]

    def _destination(self, name: str, params: dict[str, nn.Parameter]) -> tuple[str, torch.Tensor] | None:
        """The parameter an HF tensor fills and the view of it to copy into (None: not ours)."""
        d = self.d
        if name == "lm_head.weight":
            return ("lm_head", self.lm_head.data) if self.lm_head is not None else ("", torch.empty(0))
        if not name.startswith("layers."):
            return (name, params[name].data) if name in params else None
        _, idx, rest = name.split(".", 2)
        depth = int(idx) - d.layers
        prefix = f"layers.{idx}." if depth < 0 else f"mtp_layers.{depth}.block."
        if depth >= 0 and rest in _MTP_NAMES:
            target = f"mtp_layers.{depth}.{_MTP_NAMES[rest]}"
            return (target, params[target].data) if target in params else None
        attn = {"self_attn.q_a_proj.weight": (0, d.q_lora or 0),
                "self_attn.q_proj.weight": (0, d.heads * d.qk_head),
                "self_attn.kv_a_proj_with_mqa.weight": (d.q_lora or d.heads * d.qk_head, d.kv_lora + d.rope)}
        simple = {"self_attn.q_b_proj.weight": "self_attn.q_b_weight",
                  "self_attn.kv_b_proj.weight": "self_attn.kv_b_weight",
                  "self_attn.o_proj.weight": "self_attn.o_weight",
                  "mlp.gate.weight": "mlp.gate_weight",
                  "mlp.gate.e_score_correction_bias": "mlp.e_score_correction_bias",
                  "mlp.experts.gate_up_proj": "mlp.w13", "mlp.experts.down_proj": "mlp.w2"}
        target, view = None, None
        if rest in attn:
            target = prefix + "self_attn.qkv_a_weight"
            if target in params:
                view = params[target].data.narrow(0, *attn[rest])
        elif rest in simple:
            target = prefix + simple[rest]
        elif rest.startswith("mlp.experts."):
            _, _, e, proj = rest.split(".", 3)
            if proj in _MLP_NAMES:
                target = prefix + ("mlp.w2" if proj == "down_proj.weight" else "mlp.w13")
                if target in params:
                    view = params[target].data[int(e)]
                    if proj != "down_proj.weight":
                        view = view.narrow(0, _MLP_NAMES[proj][1] * d.moe_intermediate, d.moe_intermediate)
        else:
            parts = rest.rsplit(".", 2)  # e.g. mlp.shared_experts | gate_proj | weight
            owner, proj = parts[0], ".".join(parts[1:])
            if proj in _MLP_NAMES and owner in ("mlp", "mlp.shared_experts"):
                suffix, part = _MLP_NAMES[proj]
                target = f"{prefix}{owner}.{suffix}"
                if target in params and part is not None:
                    half = params[target].shape[0] // 2
                    view = params[target].data.narrow(0, part * half, half)
            else:
                target = prefix + rest
        if target is None or target not in params:
            return None
        return target, params[target].data if view is None else view

    def build_mtp_layers(self) -> None:
        """Create the ``num_nextn_predict_layers`` MTP layers, unfilled, if there are none yet (dummy
        weights fill them; ``load_weights`` builds them itself from the checkpoint)."""
        if not self.mtp_layers:
            self._build_mtp()

    def _build_mtp(self) -> None:
        """Create the MTP layers (on the first MTP tensor seen)."""
        d = self.d
        self.mtp_layers.extend(DeepseekMTPLayer(d, d.layers + k, self._rotary, **self._kw) for k in range(d.num_mtp))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        skipped_mtp = 0
        for name, tensor in dequantize_fp8_checkpoint(weights, self.d.fp8_block):
            name = name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name.startswith("layers.") and int(name.split(".", 2)[1]) >= self.d.layers:
                depth = int(name.split(".", 2)[1]) - self.d.layers
                if depth >= self.d.num_mtp or name.split(".", 2)[2] in _MTP_SHARED:
                    skipped_mtp += 1  # past num_nextn_predict_layers, or a copy of the shared embed/head
                    continue
                if not self.mtp_layers:
                    self._build_mtp()
                    params = dict(self.named_parameters())
            dest = self._destination(name, params)
            if dest is None:
                raise ValueError(f"weight {name!r} does not belong to {self.architecture}")
            target, view = dest
            if not target:  # lm_head of a tied model
                continue
            if view.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}")
            view.copy_(tensor)
            filled[target] = filled.get(target, 0) + view.numel()
        if skipped_mtp:
            logger.info("%s: skipped %d MTP tensors (shared embed/head copies, or past num_nextn_predict_layers)",
                        self.architecture, skipped_mtp)
        loaded = {n for n, count in filled.items() if count >= params[n].numel()}
        mtp_names = {n for n in params if n.startswith("mtp_layers.")}
        if mtp_names and not mtp_names <= loaded:
            missing = sorted(mtp_names - loaded)
            logger.warning("%s: the checkpoint's MTP layers are incomplete (%d tensors missing, e.g. %s); "
                           "MTP is not loaded", self.architecture, len(missing), missing[0])
            self.mtp_layers = nn.ModuleList()
            loaded -= mtp_names
        return loaded


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    architecture = "DeepseekV2ForCausalLM"
