"""``general.architecture`` ``llama``: a ``LlamaForCausalLM``. llama.cpp's converter reorders the rows of
the Q and K projections per head into its interleaved rope layout; ``undo_rope_permutation`` puts them back."""

from __future__ import annotations

from typing import Any

import numpy as np

from deepinfer.errors import ConfigError
from deepinfer.model.gguf_convert.metadata import as_float32_literal
from deepinfer.model.gguf_convert.weights import Architecture, common_config, rope_parameters

LLAMA_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def llama_config(meta: dict[str, Any], arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    """A ``LlamaConfig``: the shared keys, the rope parameters, the RMSNorm epsilon and a SiLU MLP."""
    config = common_config(meta, arch, vocab_size, tied)
    rope = rope_parameters(meta, arch, config["head_dim"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **config,
        "rms_norm_eps": as_float32_literal(float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))),
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "hidden_act": "silu",
        "mlp_bias": False,
    }


def undo_rope_permutation(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's per-head row reorder of a Q or K projection.

    Within each head, llama.cpp stores row pairs (i, i + d/2) next to each other; HF keeps the two
    halves apart. Viewing the rows as (head, pair index, 2) and swapping the last two axes undoes it.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ConfigError(f"cannot undo the rope permutation: {rows} rows do not split into {n_head} heads")
    tail = weight.shape[1:]
    split = weight.reshape(n_head, rows // n_head // 2, 2, *tail)
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(weight.shape))


def finish_llama_tensor(name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    if name.endswith("self_attn.q_proj.weight"):
        return undo_rope_permutation(values, config["num_attention_heads"])
    if name.endswith("self_attn.k_proj.weight"):
        return undo_rope_permutation(values, config["num_key_value_heads"])
    return values


LLAMA = Architecture(llama_config, LLAMA_NORMS, {}, finish_llama_tensor)
