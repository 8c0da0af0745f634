"""``general.architecture`` ``gemma3``: a ``Gemma3ForCausalLM``. llama.cpp stores Gemma's RMSNorm weights
as ``1 + w``; the conversion subtracts 1 again, as transformers' own GGUF loader does. Gemma's rope is
rotate-halves in llama.cpp too, so its projection rows are left alone."""

from __future__ import annotations

from typing import Any

import numpy as np

from deepinfer.model.gguf_convert.metadata import as_float32_literal, optional_float, require_int
from deepinfer.model.gguf_convert.weights import Architecture, common_config, rope_parameters

# Gemma-3's sandwich norms; llama.cpp's "ffn_norm" is the MLP's pre-norm here, not Llama's post-attention one.
GEMMA3_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
GEMMA3_HEAD_NORMS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

# What llama.cpp's gemma3 loader fixes instead of reading it from the file (src/llama-model.cpp): every
# 6th layer is global, sliding layers use rope base 10000 unscaled, and queries are scaled by
# head_dim ** -0.5, except in the 62-layer 27B model, which scales by (hidden / heads) ** -0.5.
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0
_GEMMA3_27B_LAYERS = 62


def gemma3_config(meta: dict[str, Any], arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    """A ``Gemma3TextConfig``: the file gives the global rope and the window; llama.cpp's fixed choices
    (`_GEMMA3_GLOBAL_EVERY`, ...) give the layer pattern, the local rope and the query scale."""
    config = common_config(meta, arch, vocab_size, tied)
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    big = layers == _GEMMA3_27B_LAYERS
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **config,
        "rms_norm_eps": as_float32_literal(float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6))),
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if big else head_dim,
        "sliding_window": require_int(meta, f"{arch}.attention.sliding_window"),
        "layer_types": [
            "full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention" for i in range(layers)
        ],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
            "full_attention": rope_parameters(meta, arch, head_dim),
        },
        "final_logit_softcapping": optional_float(meta, f"{arch}.final_logit_softcapping"),
        "attn_logit_softcapping": optional_float(meta, f"{arch}.attn_logit_softcapping"),
        "use_bidirectional_attention": False,
    }


def finish_gemma3_tensor(name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    # llama.cpp stored 1 + w for every Gemma norm; HF's Gemma wants w back (float32 arithmetic, so the
    # bits equal transformers' own `weights - 1`).
    return values - np.float32(1.0) if name.endswith("norm.weight") else values


GEMMA3 = Architecture(gemma3_config, GEMMA3_NORMS, GEMMA3_HEAD_NORMS, finish_gemma3_tensor)
