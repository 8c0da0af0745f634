"""Convert a llama.cpp GGUF checkpoint into a plain Hugging Face folder.

The result is an ordinary fp32 `LlamaForCausalLM` or `Gemma3ForCausalLM` folder (config.json,
model.safetensors, tokenizer.json, ...), so the rest of deepinfer only ever loads one format. This
needs numpy, gguf, safetensors and tokenizers; it does not import transformers or torch.

Four things about GGUF files matter here:

* Tensor shapes are stored innermost-first (`[in, out]`); the reader hands the data back row-major as
  `(out, in)`, still quantized, and `gguf.quants.dequantize` expands it to float32 values.
* llama.cpp's converter reorders the rows of the Q and K projections, per head, from Hugging Face's
  "rotate halves" rope layout into the interleaved-pairs layout that its own rope kernel expects.
  `_undo_rope_permutation` puts them back. Gemma uses rotate-halves rope in llama.cpp too, so its
  rows are left alone.
* llama.cpp's converter stores Gemma's RMSNorm weights as ``1 + w`` (its norm kernel multiplies by
  the weight), while Hugging Face's Gemma keeps ``w`` and multiplies by ``1 + w``; the conversion
  subtracts 1 again, exactly as transformers' own GGUF loader does.
* The tokenizer is stored as metadata (tokens, merges or scores, token types, a pre-tokenizer
  *name*), not as a tokenizer.json; `build_tokenizer` rebuilds one with the `tokenizers` library. The
  split rules for each pre-tokenizer name follow llama.cpp's `llama-vocab.cpp`, which is what the file
  was made for.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from deepinfer.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["build_tokenizer", "convert_gguf_to_hf", "read_gguf_metadata"]

# llama.cpp token types (enum llama_token_type in llama.h).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Per-layer tensors: llama.cpp suffix after "blk.N." -> HF suffix after "model.layers.N.".
_PROJECTIONS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# Gemma-3's sandwich norms; llama.cpp's "ffn_norm" is the MLP's pre-norm here, not Llama's post-attention one.
_GEMMA3_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA3_HEAD_NORMS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# What llama.cpp's gemma3 loader fixes instead of reading it from the file (src/llama-model.cpp): every
# 6th layer is global, sliding layers use rope base 10000 unscaled, and queries are scaled by
# head_dim ** -0.5, except in the 62-layer 27B model, which scales by (hidden / heads) ** -0.5.
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0
_GEMMA3_27B_LAYERS = 62

# Split rules by `tokenizer.ggml.pre`, as llama.cpp applies them (llama-vocab.cpp).
# "digits": every \p{N} character is cut out on its own first, then the GPT-2 rule runs on the rest.
# This is the original SmolLM/StarCoder tokenizer.json shape: Sequence[Digits(individual), ByteLevel].
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
# "gpt2": only the GPT-2 regex, which ByteLevel(use_regex=True) carries built in.
_GPT2_ONLY = ("gpt2", "default", "mpt", "olmo", "jais", "trillion", "granite-docling")
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX_BY_PRE = {
    **{name: _LLAMA3_REGEX for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")},
    **{name: _QWEN2_REGEX for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
}


# ----------------------------------------------------------------------------------------------
# Metadata
# ----------------------------------------------------------------------------------------------


def read_gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value field of the file as plain Python values (str, int, float, bool or lists)."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or not field.types:
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY and not isinstance(value, list):
            value = list(value)
        meta[key] = value
    return meta


def _as_float32_literal(value: float) -> float:
    """The shortest decimal that round-trips through float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _require_int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise ConfigError(f"GGUF metadata lacks {key!r}, which the Llama conversion needs")
    return int(value)


def _token_id(meta: dict[str, Any], name: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(value)


def _optional_float(meta: dict[str, Any], key: str) -> float | None:
    value = meta.get(key)
    return None if value is None else _as_float32_literal(float(value))


def _common_config(meta: dict[str, Any], arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    """The config keys every supported architecture reads the same way."""
    hidden = _require_int(meta, f"{arch}.embedding_length")
    n_head = _require_int(meta, f"{arch}.attention.head_count")
    head_dim = _require_int(meta, f"{arch}.attention.key_length", hidden // n_head)
    value_dim = _require_int(meta, f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ConfigError(f"GGUF attention.value_length={value_dim} differs from key_length={head_dim}; not supported")
    bos, eos, pad = (_token_id(meta, name) for name in ("bos", "eos", "padding"))
    return {
        "hidden_size": hidden,
        "intermediate_size": _require_int(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _require_int(meta, f"{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": _require_int(meta, f"{arch}.attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "max_position_embeddings": _require_int(meta, f"{arch}.context_length", 2048),
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


def _rope_parameters(meta: dict[str, Any], arch: str, head_dim: int) -> dict[str, Any]:
    """``rope_parameters`` from ``{arch}.rope.*``: default or linear scaling over the whole head."""
    rope_dim = _require_int(meta, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ConfigError(
            f"GGUF rope.dimension_count={rope_dim} differs from head_dim={head_dim}; "
            f"partial rotary embeddings are not supported for {arch}"
        )
    rope_theta = _as_float32_literal(float(meta.get(f"{arch}.rope.freq_base", 10000.0)))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = _as_float32_literal(float(meta[f"{arch}.rope.scaling.factor"]))
        return {"rope_type": "linear", "rope_theta": rope_theta, "factor": factor}
    if scaling not in ("none", None):
        raise ConfigError(f"GGUF rope scaling type {scaling!r} is not supported (only 'none' and 'linear')")
    return {"rope_type": "default", "rope_theta": rope_theta}


def _llama_config(meta: dict[str, Any], arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    config = _common_config(meta, arch, vocab_size, tied)
    rope_parameters = _rope_parameters(meta, arch, config["head_dim"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **config,
        "rms_norm_eps": _as_float32_literal(float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))),
        "rope_theta": rope_parameters["rope_theta"],
        "rope_parameters": rope_parameters,
        "hidden_act": "silu",
        "mlp_bias": False,
    }


def _gemma3_config(meta: dict[str, Any], arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
    """A ``Gemma3TextConfig``: the file gives the global rope and the window; llama.cpp's fixed choices
    (`_GEMMA3_GLOBAL_EVERY`, ...) give the layer pattern, the local rope and the query scale."""
    config = _common_config(meta, arch, vocab_size, tied)
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    big = layers == _GEMMA3_27B_LAYERS
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **config,
        "rms_norm_eps": _as_float32_literal(float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6))),
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if big else head_dim,
        "sliding_window": _require_int(meta, f"{arch}.attention.sliding_window"),
        "layer_types": [
            "full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention" for i in range(layers)
        ],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
            "full_attention": _rope_parameters(meta, arch, head_dim),
        },
        "final_logit_softcapping": _optional_float(meta, f"{arch}.final_logit_softcapping"),
        "attn_logit_softcapping": _optional_float(meta, f"{arch}.attn_logit_softcapping"),
        "use_bidirectional_attention": False,
    }


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _undo_rope_permutation(weight: np.ndarray, n_head: int) -> np.ndarray:
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


def _finish_llama_tensor(name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    if name.endswith("self_attn.q_proj.weight"):
        return _undo_rope_permutation(values, config["num_attention_heads"])
    if name.endswith("self_attn.k_proj.weight"):
        return _undo_rope_permutation(values, config["num_key_value_heads"])
    return values


def _finish_gemma3_tensor(name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    # llama.cpp stored 1 + w for every Gemma norm; HF's Gemma wants w back (float32 arithmetic, so the
    # bits equal transformers' own `weights - 1`).
    return values - np.float32(1.0) if name.endswith("norm.weight") else values


@dataclass(frozen=True)
class _Architecture:
    """How one `general.architecture` maps onto a Hugging Face model."""

    build_config: Callable[[dict[str, Any], str, int, bool], dict[str, Any]]
    layer_norms: dict[str, str]  # llama.cpp -> HF suffix, norms of width hidden_size
    head_norms: dict[str, str]  # llama.cpp -> HF suffix, per-head norms of width head_dim
    finish_tensor: Callable[[str, np.ndarray, dict[str, Any]], np.ndarray]

    @property
    def layer_tensors(self) -> dict[str, str]:
        return {**_PROJECTIONS, **self.layer_norms, **self.head_norms}


_ARCHITECTURES = {
    "llama": _Architecture(_llama_config, _LLAMA_NORMS, {}, _finish_llama_tensor),
    "gemma3": _Architecture(_gemma3_config, _GEMMA3_NORMS, _GEMMA3_HEAD_NORMS, _finish_gemma3_tensor),
}


def _hf_name(gguf_name: str, n_layers: int, layer_tensors: dict[str, str]) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and int(layer) < n_layers and suffix in layer_tensors:
        return f"model.layers.{int(layer)}.{layer_tensors[suffix]}"
    raise ConfigError(f"GGUF tensor {gguf_name!r} has no counterpart in a Hugging Face model")


def _load_tensors(reader: GGUFReader, config: dict[str, Any], arch: _Architecture) -> dict[str, np.ndarray]:
    n_layers, layer_tensors = config["num_hidden_layers"], arch.layer_tensors
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, n_layers, layer_tensors)
        shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        tensors[name] = np.ascontiguousarray(arch.finish_tensor(name, values, config))
    return tensors


def _check_tensors(tensors: dict[str, np.ndarray], config: dict[str, Any], arch: _Architecture) -> None:
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


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies.

    Bytes that are already visible, non-space Latin-1 characters stand for themselves; the 68 others
    (controls, space, DEL, NBSP, soft hyphen, ...) are moved, in byte order, to code points 256 and up.
    """
    visible = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {byte: chr(byte) for byte in visible}
    shifted = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def _pre_tokenizer_for(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_REGEX_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        )
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in _GPT2_ONLY:
        logger.warning("GGUF pre-tokenizer %r is not known here; using the plain GPT-2 split rule", pre)
    return gpt2


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the tokenizer described by GGUF metadata: byte-level BPE
    (`tokenizer.ggml.model` "gpt2") or SentencePiece BPE ("llama", as Gemma files use)."""
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise ConfigError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types")
    if model == "gpt2":
        tokenizer, vocab, may_be_control = _byte_level_bpe(meta, tokens)
    elif model == "llama":
        tokenizer, vocab = _sentencepiece_bpe(meta, tokens)
        may_be_control = None
    else:
        raise ConfigError(f"GGUF tokenizer model {model!r} is not supported (only 'gpt2' and 'llama')")

    # Control tokens (like <|im_start|>) must be matched whole and are skipped on decode.
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _TOKEN_TYPE_CONTROL and (may_be_control is None or may_be_control(token))
    ]
    if special:
        tokenizer.add_special_tokens(special)
    # User-defined tokens are matched whole as well but kept on decode.
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == _TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    if user:
        tokenizer.add_tokens(user)

    template = _post_processor(meta, tokens)
    if template is not None:
        tokenizer.post_processor = template
    return tokenizer


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, dict[str, int], Callable[[str], bool]]:
    """GPT-2 style BPE with the file's merges; also returns the vocabulary and which tokens may be control
    tokens (a control token spelled outside the byte alphabet is a llama.cpp mislabel and would only grow
    the vocabulary)."""
    merges_raw: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    if not merges_raw:
        raise ConfigError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())

    def respell(token: str) -> str:
        # Byte-level vocabularies write every token in the byte alphabet; a token that is not
        # (rare: an added token with a raw space) is rewritten byte by byte so BPE can reach it.
        if set(token) <= spelled:
            return token
        return "".join(alphabet[byte] for byte in token.encode("utf-8"))

    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(respell(token), index)
    merges: list[tuple[str, str]] = []
    for merge in merges_raw:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ConfigError(f"malformed GGUF merge {merge!r}")
        merges.append((left, right))

    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = _pre_tokenizer_for(meta.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, vocab, lambda token: set(token) <= spelled


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, dict[str, int]]:
    """SentencePiece BPE as llama.cpp's SPM tokenizer runs it: spaces are written "▁", the whole text is
    one piece, adjacent symbols merge best-first, and characters outside the vocabulary fall back to
    the <0xNN> byte tokens.

    The file has no merges, only tokens best-first. A merge's rank is the position of the token it
    makes (the scores of Gemma files rank special and byte tokens out of that order, so positions, not
    scores, are used), and one token's two-piece splits rank longest left piece first."""
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        raise ConfigError(
            "GGUF SentencePiece tokenizers with add_space_prefix=true are not supported "
            "(only those without a space prefix, like Gemma's)"
        )
    # A run of spaces is stored with real spaces (Gemma's user-defined space tokens), but the normalizer
    # writes every space as "▁", so BPE can only reach such a token spelled that way.
    spelled = ["▁" * len(token) if token and set(token) == {" "} else token for token in tokens]
    vocab: dict[str, int] = {}
    for index, token in enumerate(spelled):
        vocab.setdefault(token, index)
    merges = [
        (token[:cut], token[cut:])
        for token in spelled
        for cut in range(len(token) - 1, 0, -1)
        if token[:cut] in vocab and token[cut:] in vocab
    ]
    unk = _token_id(meta, "unknown")
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer, vocab


def _adds_bos(meta: dict[str, Any]) -> bool:
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor | None:
    add_bos = _adds_bos(meta)
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = _token_id(meta, "bos"), _token_id(meta, "eos")
    prefix = [(tokens[bos], bos)] if add_bos and bos is not None else []
    suffix = [(tokens[eos], eos)] if add_eos and eos is not None else []
    if not prefix and not suffix:
        return None
    head = " ".join(token for token, _ in prefix)
    tail = " ".join(token for token, _ in suffix)
    single = " ".join(part for part in (head, "$A", tail) if part)
    pair = " ".join(part for part in (single, head, "$B:1", tail) if part)
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=prefix + suffix)


def _tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def token_text(name: str) -> str | None:
        token_id = _token_id(meta, name)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_text("bos"),
        "eos_token": token_text("eos"),
        "pad_token": token_text("padding"),
        "unk_token": token_text("unknown"),
        "add_bos_token": _adds_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }


def _generation_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    eos: int | list[int] | None = config["eos_token_id"]
    eot = _token_id(meta, "eot")
    if eos is not None and eot is not None and eot != eos:
        eos = [eos, eot]
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos,
        "pad_token_id": config["pad_token_id"],
    }


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _finish_tree(folder: Path) -> None:
    """Make the staged files world-readable (mkdtemp and safetensors create them private) and durable."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a Llama or Gemma-3 GGUF file into an fp32 Hugging Face folder at `out_dir`.

    The folder holds config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json and (when the GGUF has one) chat_template.jinja. It is written into a
    sibling temporary folder and renamed into place, so a crash never leaves a half-written
    `out_dir`. `out_dir` must not exist, or be an empty folder. Returns `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"conversion target {out_dir} already exists and is not an empty folder")
    started = time.perf_counter()
    reader = GGUFReader(gguf_path)
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ConfigError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported (only {', '.join(sorted(_ARCHITECTURES))})"
        )
    layout = _ARCHITECTURES[arch]

    names = {tensor.name for tensor in reader.tensors}
    tied = "output.weight" not in names
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ConfigError(f"{gguf_path}: GGUF has no token_embd.weight tensor")
    vocab_size = int(embed.shape[-1])
    declared = meta.get(f"{arch}.vocab_size")
    if declared is not None and int(declared) != vocab_size:
        raise ConfigError(f"{gguf_path}: {arch}.vocab_size={declared} but token_embd has {vocab_size} rows")

    config = layout.build_config(meta, arch, vocab_size, tied)
    tensors = _load_tensors(reader, config, layout)
    _check_tensors(tensors, config, layout)
    tokenizer = build_tokenizer(meta)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", _generation_config(meta, config))
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", _tokenizer_config(meta, config))
        template = meta.get("tokenizer.chat_template")
        if template:
            (staging / "chat_template.jinja").write_text(template, encoding="utf-8")
        _finish_tree(staging)
        if out_dir.is_dir():
            out_dir.rmdir()  # empty, checked above; rename() cannot replace it otherwise
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    elapsed = time.perf_counter() - started
    logger.info("converted %s -> %s (%d tensors, %.1fs)", gguf_path, out_dir, len(tensors), elapsed)
    return out_dir
