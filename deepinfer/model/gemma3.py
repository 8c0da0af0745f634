"""Gemma-3 text decoder: ``Gemma3ForCausalLM``.

It keeps the Llama family's fused parameter layout (``qkv_weight``, ``o_weight``, ``gate_up_weight``,
``down_weight``), so checkpoint loading and the GEMM weight list are ``LlamaForCausalLM``'s. What differs:

- the token embedding is scaled by ``sqrt(hidden)`` (rounded to the model dtype, as HF does);
- every RMSNorm scales by ``1 + weight`` (``OffsetRMSNorm``), q and k are normed per head before rope;
- sandwich norms: the attention and MLP outputs are normed before they join the residual stream, and
  the MLP input has its own pre-norm (``pre_feedforward_layernorm``);
- the MLP is ``down(gelu_tanh(gate) * up)``;
- ``layer_types`` alternates sliding-window layers (``sliding_window``, local rope theta) with global
  layers (global rope theta); the sliding layers keep full paged KV and the attention backend applies
  the window (``PagedKVSpec(window=…)``, so replay planners see them as ``sliding``);
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- logits are soft-capped, ``c · tanh(logits / c)``, when ``final_logit_softcapping`` is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.errors import ConfigError
from deepinfer.interfaces import ForwardContext
from deepinfer.kv.specs import PagedKVSpec
from deepinfer.model.base import config_value
from deepinfer.model.layers.norm import OffsetRMSNorm
from deepinfer.model.layers.rope import RotaryEmbedding
from deepinfer.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

_LAYER_TYPES = ("sliding_attention", "full_attention")


class _Gemma3Dims:
    """The shape facts of a Gemma-3 text config; defaults are ``Gemma3TextConfig``'s."""

    def __init__(self, hf_config: dict[str, Any]) -> None:
        self.hidden = hf_config["hidden_size"]
        self.heads = hf_config["num_attention_heads"]
        self.kv_heads = config_value(hf_config, "num_key_value_heads", default=self.heads)
        self.head_dim = config_value(hf_config, "head_dim", default=256)
        self.intermediate = hf_config["intermediate_size"]
        self.layers = hf_config["num_hidden_layers"]
        self.vocab = hf_config["vocab_size"]
        self.eps = config_value(hf_config, "rms_norm_eps", default=1e-6)
        self.tied = bool(hf_config.get("tie_word_embeddings", True))
        self.qkv_bias = bool(hf_config.get("attention_bias", False))
        self.qk_norm = False  # Gemma's q/k norms are OffsetRMSNorm, built by Gemma3Attention itself
        self.window = int(config_value(hf_config, "sliding_window", default=4096))
        self.scale = float(config_value(hf_config, "query_pre_attn_scalar", default=256)) ** -0.5
        self.final_softcap = hf_config.get("final_logit_softcapping")
        self.layer_types = _layer_types(hf_config, self.layers)
        act = config_value(hf_config, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"config.json hidden_activation must be 'gelu_pytorch_tanh' for Gemma3ForCausalLM, "
                              f"got {act!r}")
        if hf_config.get("attn_logit_softcapping") is not None:
            raise ConfigError("config.json attn_logit_softcapping is not supported for Gemma3ForCausalLM "
                              "(the paged attention backends have no score soft-capping); set it to null")
        if hf_config.get("use_bidirectional_attention"):
            raise ConfigError("config.json use_bidirectional_attention=true is not supported for a causal LM")


def _layer_types(hf_config: dict[str, Any], layers: int) -> list[str]:
    """``layer_types`` as saved, or derived from the legacy ``sliding_window_pattern`` (every n-th layer
    is global; HF's default n is 6)."""
    types = hf_config.get("layer_types")
    if types is None:
        pattern = int(hf_config.get("sliding_window_pattern") or 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= set(_LAYER_TYPES):
        raise ConfigError(f"config.json layer_types must list {layers} entries from {_LAYER_TYPES}, got {types}")
    return list(types)


def _rope_configs(hf_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per layer type, a config ``RotaryEmbedding`` reads. transformers 5 saves ``rope_parameters`` keyed
    by layer type; older configs give ``rope_theta`` (+ ``rope_scaling``) for global layers and
    ``rope_local_base_freq`` for sliding ones."""
    params = hf_config.get("rope_parameters") or {}
    if set(params) & set(_LAYER_TYPES):
        per_type = {t: dict(params.get(t) or {}) for t in _LAYER_TYPES}
    else:
        per_type = {"full_attention": {**(hf_config.get("rope_scaling") or {}), **params},
                    "sliding_attention": {"rope_type": "default"}}
        per_type["full_attention"].setdefault("rope_theta", hf_config.get("rope_theta", 1_000_000.0))
        per_type["sliding_attention"]["rope_theta"] = hf_config.get("rope_local_base_freq", 10_000.0)
    per_type["full_attention"].setdefault("rope_theta", 1_000_000.0)
    per_type["sliding_attention"].setdefault("rope_theta", 10_000.0)
    return {t: {"rope_parameters": p, "max_position_embeddings": hf_config.get("max_position_embeddings")}
            for t, p in per_type.items()}


class Gemma3Attention(LlamaAttention):
    """Llama attention's fused projections with Gemma's offset q/k norms, score scale and window
    (0 on global layers)."""

    def __init__(self, d: _Gemma3Dims, rotary: RotaryEmbedding, window: int, **kw: Any) -> None:
        super().__init__(d, rotary, **kw)  # type: ignore[arg-type]  # duck-typed: the fields LlamaAttention reads
        self.q_norm = OffsetRMSNorm(d.head_dim, d.eps, **kw)
        self.k_norm = OffsetRMSNorm(d.head_dim, d.eps, **kw)
        self.scale = d.scale
        self.window = window

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        d, gemm = self.d, ctx.backends["linear"]
        q, k, v = gemm.linear(x, self.qkv_weight, self.qkv_bias).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = self.q_norm(q.reshape(-1, d.heads, d.head_dim))
        k = self.k_norm(k.reshape(-1, d.kv_heads, d.head_dim))
        q, k = self.rotary(positions, q, k)
        out = ctx.backends["paged_attention"].paged_attention(
            q, k, v.reshape(-1, d.kv_heads, d.head_dim).contiguous(), self.kv_cache, ctx,
            scale=self.scale, window=self.window)
        return gemm.linear(out.reshape(-1, self.q_size), self.o_weight)


class Gemma3MLP(LlamaMLP):
    """The fused gate/up MLP with GELU (tanh approximation) in place of SiLU."""

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gemm = ctx.backends["linear"]
        gate, up = gemm.linear(x, self.gate_up_weight).split(self.intermediate, dim=-1)
        return gemm.linear(F.gelu(gate, approximate="tanh") * up, self.down_weight)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-normed block: ``x += post_attn(attn(in(x)))``, then ``x += post_ff(mlp(pre_ff(x)))``."""

    def __init__(self, d: _Gemma3Dims, rotary: RotaryEmbedding, window: int, **kw: Any) -> None:
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(d.hidden, d.eps, **kw)
        self.self_attn = Gemma3Attention(d, rotary, window, **kw)
        self.post_attention_layernorm = OffsetRMSNorm(d.hidden, d.eps, **kw)
        self.pre_feedforward_layernorm = OffsetRMSNorm(d.hidden, d.eps, **kw)
        self.mlp = Gemma3MLP(d, **kw)  # type: ignore[arg-type]
        self.post_feedforward_layernorm = OffsetRMSNorm(d.hidden, d.eps, **kw)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), ctx))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma-3 text decoder over the paged KV cache (sliding layers: full paged KV, windowed reads).

    Inherits ``load_weights``, ``gemm_weights`` and ``bind_cache``: the parameter names match the Llama
    layout, and the extra norms load by name."""

    architecture = "Gemma3ForCausalLM"

    def __init__(self, hf_config: dict[str, Any], *, dtype: torch.dtype, device: torch.device,
                 max_positions: int) -> None:
        nn.Module.__init__(self)  # not LlamaForCausalLM.__init__: Gemma builds its own layers
        self.d = d = _Gemma3Dims(hf_config)
        kw = {"dtype": dtype, "device": device}
        self.vocab_size = d.vocab
        self.embed_tokens = nn.Embedding(d.vocab, d.hidden, **kw)
        # HF multiplies by sqrt(hidden) cast to the weight dtype (55.4256 becomes 55.5 in bfloat16).
        self.register_buffer("embed_scale", torch.tensor(d.hidden ** 0.5, dtype=dtype, device=device),
                             persistent=False)
        rope = _rope_configs(hf_config)
        rotaries = {t: RotaryEmbedding(rope[t], d.head_dim, max_positions, device=device)
                    for t in sorted(set(d.layer_types))}
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(d, rotaries[t], d.window if t == "sliding_attention" else 0, **kw)
            for t in d.layer_types)
        self.norm = OffsetRMSNorm(d.hidden, d.eps, **kw)
        self.lm_head = None if d.tied else nn.Parameter(torch.empty(d.vocab, d.hidden, **kw))

    def cache_specs(self) -> Sequence[PagedKVSpec]:
        return [PagedKVSpec(self.d.kv_heads, self.d.head_dim, window=layer.self_attn.window) for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.norm(self.run_layers(self.embed_tokens(input_ids) * self.embed_scale, ctx))

    def compute_logits(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        logits = super().compute_logits(hidden, ctx)
        cap = self.d.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
