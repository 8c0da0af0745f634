"""SentencePiece BPE (``tokenizer.ggml.model`` ``llama``, as Gemma files use) rebuilt from GGUF metadata:
merges ranked from the token order, byte fallback."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, normalizers
from tokenizers.models import BPE

from deepinfer.errors import ConfigError
from deepinfer.model.gguf_convert.metadata import token_id


def sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, dict[str, int]]:
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
    unk = token_id(meta, "unknown")
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
