"""The tokenizer a GGUF file describes (tokens, merges or scores, token types, a pre-tokenizer name; not a
tokenizer.json), rebuilt with the ``tokenizers`` library (``byte_bpe.py``, ``sentencepiece.py``), plus
the tokenizer_config.json and generation_config.json written beside it."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from deepinfer.errors import ConfigError
from deepinfer.model.gguf_convert.byte_bpe import byte_level_bpe
from deepinfer.model.gguf_convert.metadata import token_id
from deepinfer.model.gguf_convert.sentencepiece import sentencepiece_bpe

# llama.cpp token types (enum llama_token_type in llama.h).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the tokenizer described by GGUF metadata: byte-level BPE
    (`tokenizer.ggml.model` "gpt2") or SentencePiece BPE ("llama", as Gemma files use)."""
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise ConfigError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types")
    if model == "gpt2":
        tokenizer, vocab, may_be_control = byte_level_bpe(meta, tokens)
    elif model == "llama":
        tokenizer, vocab = sentencepiece_bpe(meta, tokens)
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


def _adds_bos(meta: dict[str, Any]) -> bool:
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor | None:
    add_bos = _adds_bos(meta)
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = token_id(meta, "bos"), token_id(meta, "eos")
    prefix = [(tokens[bos], bos)] if add_bos and bos is not None else []
    suffix = [(tokens[eos], eos)] if add_eos and eos is not None else []
    if not prefix and not suffix:
        return None
    head = " ".join(token for token, _ in prefix)
    tail = " ".join(token for token, _ in suffix)
    single = " ".join(part for part in (head, "$A", tail) if part)
    pair = " ".join(part for part in (single, head, "$B:1", tail) if part)
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=prefix + suffix)


def tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def token_text(name: str) -> str | None:
        index = token_id(meta, name)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

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


def generation_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    eos: int | list[int] | None = config["eos_token_id"]
    eot = token_id(meta, "eot")
    if eos is not None and eot is not None and eot != eos:
        eos = [eos, eot]
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos,
        "pad_token_id": config["pad_token_id"],
    }
