"""What every supported architecture shares: the tensor names, the config keys read the same way,
the rope parameters, and loading (dequantizing) and shape-checking the tensors; an ``Architecture``
(``llama.py``, ``gemma3.py``) supplies the rest."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from deepinfer.errors import ConfigError
from deepinfer.model.gguf_convert.metadata import as_float32_literal, require_int, token_id

# Per-layer tensors: llama.cpp suffix after "blk.N." -> HF suffix after "model.layers.N.".
PROJECTIONS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def common_config(meta: dict[str, Any], arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    """The config keys every supported architecture reads the same way."""
    hidden = require_int(meta, f"{arch}.embedding_length")
    n_head = require_int(meta, f"{arch}.attention.head_count")
    head_dim = require_int(meta, f"{arch}.attention.key_length", hidden // n_head)
    value_dim = require_int(meta, f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ConfigError(f"GGUF attention.value_length={value_dim} differs from key_length={head_dim}; not supported")
    bos, eos, pad = (token_id(meta, name) for name in ("bos", "eos", "padding"))
    return {
        "hidden_size": hidden,
        "intermediate_size": require_int(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": require_int(meta, f"{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": require_int(meta, f"{arch}.attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "max_position_embeddings": require_int(meta, f"{arch}.context_length", 2048),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def rope_parameters(meta: dict[str, Any], arch: str, head_dim: int) -> dict[str, Any]:
    """``rope_parameters`` from ``{arch}.rope.*``: default or linear scaling over the whole head."""
    rope_dim = require_int(meta, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ConfigError(
            f"GGUF rope.dimension_count={rope_dim} differs from head_dim={head_dim}; "
            f"partial rotary embeddings are not supported for {arch}"
        )
    rope_theta = as_float32_literal(float(meta.get(f"{arch}.rope.freq_base", 10000.0)))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = as_float32_literal(float(meta[f"{arch}.rope.scaling.factor"]))
        return {"rope_type": "linear", "rope_theta": rope_theta, "factor": factor}
    if scaling not in ("none", None):
        raise ConfigError(f"GGUF rope scaling type {scaling!r} is not supported (only 'none' and 'linear')")
    return {"rope_type": "default", "rope_theta": rope_theta}


@dataclass(frozen=True)
class Architecture:
    """How one `general.architecture` maps onto a Hugging Face model."""

    build_config: Callable[[dict[str, Any], str, int, bool], dict[str, Any]]
    layer_norms: dict[str, str]  # llama.cpp -> HF suffix, norms of width hidden_size
    head_norms: dict[str, str]  # llama.cpp -> HF suffix, per-head norms of width head_dim
    finish_tensor: Callable[[str, np.ndarray, dict[str, Any]], np.ndarray]

    @property
    def layer_tensors(self) -> dict[str, str]:
        return {**PROJECTIONS, **self.layer_norms, **self.head_norms}


def _hf_name(gguf_name: str, n_layers: int, layer_tensors: dict[str, str]) -> str:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and int(layer) < n_layers and suffix in layer_tensors:
        return f"model.layers.{int(layer)}.{layer_tensors[suffix]}"
    raise ConfigError(f"GGUF tensor {gguf_name!r} has no counterpart in a Hugging Face model")


def load_tensors(reader: GGUFReader, config: dict[str, Any], arch: Architecture) -> dict[str, np.ndarray]:
    n_layers, layer_tensors = config["num_hidden_layers"], arch.layer_tensors
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, n_layers, layer_tensors)
        shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        tensors[name] = np.ascontiguousarray(arch.finish_tensor(name, values, config))
    return tensors


def check_tensors(tensors: dict[str, np.ndarray], config: dict[str, Any], arch: Architecture) -> None:
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    expected = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (config["vocab_size"], hidden)
    per_layer = {
        "self_attn.q_proj.weight": (q_out, hidden),
        "self_attn.k_proj.weight": (kv_out, hidden),
        "self_attn.v_proj.weight": (kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        **{suffix: (hidden,) for suffix in arch.layer_norms.values()},
        **{suffix: (head_dim,) for suffix in arch.head_norms.values()},
    }
    for layer in range(config["num_hidden_layers"]):
        for suffix, shape in per_layer.items():
            expected[f"model.layers.{layer}.{suffix}"] = shape
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ConfigError(f"GGUF lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ConfigError(f"tensor {name} has shape {tensors[name].shape}, expected {shape}")
