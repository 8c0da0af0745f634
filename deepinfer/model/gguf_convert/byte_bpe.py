"""Byte-level BPE (``tokenizer.ggml.model`` ``gpt2``, e.g. SmolLM2) rebuilt from GGUF metadata: the file's
merges, GPT-2's byte alphabet, and the split rules llama.cpp applies for each pre-tokenizer name
(``llama-vocab.cpp``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from deepinfer.errors import ConfigError

logger = logging.getLogger(__name__)

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


def byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, dict[str, int], Callable[[str], bool]]:
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
