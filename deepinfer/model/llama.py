"""Llama-family dense decoders: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``.

One module serves the three: Qwen2 adds biases to q/k/v, Qwen3 adds a per-head RMSNorm on q and k
before rope. q/k/v and gate/up are stored fused so each is one GEMM; ``load_weights`` fills the
slices from the separate tensors HF saves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.errors import ConfigError
from deepinfer.interfaces import DenseDecoderLayer, DenseDecoderStack, ForwardContext
from deepinfer.kv.specs import PagedKVSpec
from deepinfer.model.base import StackedDecoderLM, config_value
from deepinfer.model.layers.norm import RMSNorm
from deepinfer.model.layers.rope import RotaryEmbedding


class _Dims:
    """The shape facts of a Llama-family config."""

    def __init__(self, hf_config: dict[str, Any], arch: str) -> None:
        self.hidden = hf_config["hidden_size"]
        self.heads = hf_config["num_attention_heads"]
        self.kv_heads = config_value(hf_config, "num_key_value_heads", default=self.heads)
        self.head_dim = config_value(hf_config, "head_dim", default=self.hidden // self.heads)
        self.intermediate = hf_config["intermediate_size"]
        self.layers = hf_config["num_hidden_layers"]
        self.vocab = hf_config["vocab_size"]
        self.eps = config_value(hf_config, "rms_norm_eps", default=1e-6)
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        self.qkv_bias = arch == "Qwen2ForCausalLM" or bool(hf_config.get("attention_bias", False))
        self.qk_norm = arch == "Qwen3ForCausalLM"
        self.mlp_bias = bool(hf_config.get("mlp_bias", False))
        if hf_config.get("use_sliding_window"):
            raise ConfigError(f"config.json use_sliding_window=true is not supported for {arch}")
        if config_value(hf_config, "hidden_act", "hidden_activation", default="silu") != "silu":
            raise ConfigError(f"config.json hidden_act must be 'silu' for {arch}")


class LlamaAttention(nn.Module):
    def __init__(self, d: _Dims, rotary: RotaryEmbedding, **kw: Any) -> None:
        super().__init__()
        self.d = d
        self.q_size, self.kv_size = d.heads * d.head_dim, d.kv_heads * d.head_dim
        self.qkv_weight = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, d.hidden, **kw))
        self.qkv_bias = nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size, **kw)) if d.qkv_bias else None
        self.o_weight = nn.Parameter(torch.empty(d.hidden, self.q_size, **kw))
        if d.qk_norm:
            self.q_norm = RMSNorm(d.head_dim, d.eps, **kw)
            self.k_norm = RMSNorm(d.head_dim, d.eps, **kw)
        self.rotary = rotary
        self.scale = d.head_dim ** -0.5
        self.kv_cache: tuple[torch.Tensor, ...] = ()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        d, gemm = self.d, ctx.backends["linear"]
        qkv = gemm.linear(x, self.qkv_weight, self.qkv_bias)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].reshape(-1, d.kv_heads, d.head_dim)
        if d.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].reshape(-1, d.heads, d.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_size].reshape(-1, d.kv_heads, d.head_dim))
            q, k = self.rotary(positions, q, k)
        else:  # q's and k's heads side by side: one rotation (a batch-1 step pays per op, issue 36)
            qk = self.rotary.rotate(positions, qkv[:, :qk_size].reshape(-1, d.heads + d.kv_heads, d.head_dim))
            q, k = (t.contiguous() for t in qk.split([d.heads, d.kv_heads], dim=1))  # views already are at T = 1
        out = ctx.backends["paged_attention"].paged_attention(q, k, v.contiguous(), self.kv_cache, ctx,
                                                              scale=self.scale)
        return gemm.linear(out.reshape(-1, self.q_size), self.o_weight)


class LlamaMLP(nn.Module):
    def __init__(self, d: _Dims, **kw: Any) -> None:
        super().__init__()
        self.intermediate = d.intermediate
        self.gate_up_weight = nn.Parameter(torch.empty(2 * d.intermediate, d.hidden, **kw))
        self.down_weight = nn.Parameter(torch.empty(d.hidden, d.intermediate, **kw))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gemm = ctx.backends["linear"]
        gate, up = gemm.linear(x, self.gate_up_weight).split(self.intermediate, dim=-1)
        return gemm.linear(F.silu(gate).mul_(up), self.down_weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d: _Dims, rotary: RotaryEmbedding, **kw: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden, d.eps, **kw)
        self.self_attn = LlamaAttention(d, rotary, **kw)
        self.post_attention_layernorm = RMSNorm(d.hidden, d.eps, **kw)
        self.mlp = LlamaMLP(d, **kw)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x), ctx)


# HF tensor name suffix -> (our parameter suffix, which fused slice: None | q/k/v | gate/up)
_SLICES = {
    "self_attn.q_proj.weight": ("self_attn.qkv_weight", "q"),
    "self_attn.k_proj.weight": ("self_attn.qkv_weight", "k"),
    "self_attn.v_proj.weight": ("self_attn.qkv_weight", "v"),
    "self_attn.q_proj.bias": ("self_attn.qkv_bias", "q"),
    "self_attn.k_proj.bias": ("self_attn.qkv_bias", "k"),
    "self_attn.v_proj.bias": ("self_attn.qkv_bias", "v"),
    "self_attn.o_proj.weight": ("self_attn.o_weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_weight", "gate"),
    "mlp.up_proj.weight": ("mlp.gate_up_weight", "up"),
    "mlp.down_proj.weight": ("mlp.down_weight", None),
}


class LlamaForCausalLM(StackedDecoderLM):
    """Llama / Qwen2 / Qwen3 dense decoder over the paged KV cache."""

    architecture = "LlamaForCausalLM"
    # The backend ops this model calls (the plugin host must find a fitting backend for each).
    backend_ops = frozenset({"linear", "paged_attention"})
    _stack: DenseDecoderStack | None = None  # decoder_stack(), built on first use (a class default: subclasses
    # that build their own layers, Gemma-3, skip this __init__)

    def __init__(self, hf_config: dict[str, Any], *, dtype: torch.dtype, device: torch.device,
                 max_positions: int) -> None:
        super().__init__()
        self.d = d = _Dims(hf_config, self.architecture)
        kw = {"dtype": dtype, "device": device}
        self.vocab_size = d.vocab
        self.embed_tokens = nn.Embedding(d.vocab, d.hidden, **kw)
        rotary = RotaryEmbedding(hf_config, d.head_dim, max_positions, device=device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(d, rotary, **kw) for _ in range(d.layers))
        self.norm = RMSNorm(d.hidden, d.eps, **kw)
        self.lm_head = None if d.tied else nn.Parameter(torch.empty(d.vocab, d.hidden, **kw))

    def cache_specs(self) -> Sequence[PagedKVSpec]:
        return [PagedKVSpec(self.d.kv_heads, self.d.head_dim) for _ in range(self.d.layers)]

    def bind_cache(self, caches: Sequence[tuple[torch.Tensor, ...]]) -> None:
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.kv_cache = cache
        self._stack = None

    def capture_hidden(self, layer_ids: Sequence[int]) -> None:
        super().capture_hidden(layer_ids)
        self._stack = None

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The layers and the output norm, or the GEMM backend's ``decode_stack`` over both when it serves the
        step (a CPU step then makes one call where the norm alone made eight torch ops)."""
        x = self.embed_tokens(input_ids)
        fused = getattr(ctx.backends["linear"], "decode_stack", None)
        stack = self.decoder_stack() if fused is not None else None
        served = fused(stack, x, ctx) if stack is not None else None
        if served is None:
            return self.norm(self.run_layers(x, ctx))
        out, captured = served
        if self.captured_layers:
            self.captured_hidden = captured
        return out

    def decoder_stack(self) -> DenseDecoderStack | None:
        """The layers as ``DenseDecoderStack`` (one object per binding of the caches), or None for a subclass
        with layers of its own (Gemma-3's sandwich norms and GELU): only ``LlamaDecoderLayer``'s computation
        is the stack's."""
        d = self.d
        if self._stack is None or self._stack.captured_layers != self.captured_layers:
            if any(type(layer) is not LlamaDecoderLayer for layer in self.layers):
                return None
            attn0 = self.layers[0].self_attn
            self._stack = DenseDecoderStack(
                tuple(DenseDecoderLayer(
                    layer.input_layernorm.weight, layer.self_attn.qkv_weight, layer.self_attn.qkv_bias,
                    layer.self_attn.o_weight, layer.post_attention_layernorm.weight, layer.mlp.gate_up_weight,
                    layer.mlp.down_weight, layer.self_attn.kv_cache,
                    layer.self_attn.q_norm.weight if d.qk_norm else None,
                    layer.self_attn.k_norm.weight if d.qk_norm else None) for layer in self.layers),
                d.hidden, d.heads, d.kv_heads, d.head_dim, d.intermediate, d.eps, attn0.scale,
                attn0.rotary.cos, attn0.rotary.sin_signed, self.norm.weight, self.captured_layers)
        return self._stack

    def gemm_weights(self) -> list[nn.Parameter]:
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        per_layer = [w for layer in self.layers for w in (layer.self_attn.qkv_weight, layer.self_attn.o_weight,
                                                          layer.mlp.gate_up_weight, layer.mlp.down_weight)]
        return [*per_layer, head]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        d = self.d
        offsets = {
            "q": (0, d.heads * d.head_dim),
            "k": (d.heads * d.head_dim, d.kv_heads * d.head_dim),
            "v": ((d.heads + d.kv_heads) * d.head_dim, d.kv_heads * d.head_dim),
            "gate": (0, d.intermediate),
            "up": (d.intermediate, d.intermediate),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if name == "lm_head.weight":
                name = "lm_head"
            target, part = name, None
            if name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                if rest in _SLICES:
                    suffix, part = _SLICES[rest]
                    target = f"layers.{idx}.{suffix}"
            if target not in params:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ValueError(f"weight {name!r} does not belong to {self.architecture}")
            param = params[target]
            dest = param.data if part is None else param.data.narrow(0, *offsets[part])
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(target if part is None else f"{target}.{part}")
        return {_param_of(n) for n in loaded if _complete(n, loaded)}


def _param_of(loaded_name: str) -> str:
    for part in (".q", ".k", ".v", ".gate", ".up"):
        if loaded_name.endswith(part):
            return loaded_name[: -len(part)]
    return loaded_name


def _complete(loaded_name: str, loaded: set[str]) -> bool:
    """A fused parameter counts as loaded only when all its slices were."""
    base = _param_of(loaded_name)
    if base == loaded_name:
        return True
    parts = ("gate", "up") if base.endswith("gate_up_weight") else ("q", "k", "v")
    return all(f"{base}.{p}" in loaded for p in parts)


class Qwen2ForCausalLM(LlamaForCausalLM):
    architecture = "Qwen2ForCausalLM"


class Qwen3ForCausalLM(LlamaForCausalLM):
    architecture = "Qwen3ForCausalLM"
