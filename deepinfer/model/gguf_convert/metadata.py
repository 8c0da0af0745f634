"""GGUF metadata as plain Python values, and the typed reads the converters make of it."""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from deepinfer.errors import ConfigError


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


def as_float32_literal(value: float) -> float:
    """The shortest decimal that round-trips through float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def require_int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise ConfigError(f"GGUF metadata lacks {key!r}, which the Llama conversion needs")
    return int(value)


def token_id(meta: dict[str, Any], name: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(value)


def optional_float(meta: dict[str, Any], key: str) -> float | None:
    value = meta.get(key)
    return None if value is None else as_float32_literal(float(value))
