"""Rotary position embeddings: frequency tables for the rope types Llama-family configs use.

``rope_parameters`` (transformers 5) and the legacy ``rope_theta`` + ``rope_scaling`` are both read.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from deepinfer.errors import ConfigError
from deepinfer.model.layers.yarn import yarn_inverse_frequencies


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config, merged from ``rope_parameters`` or the legacy keys."""
    params = dict(hf_config.get("rope_parameters") or {})
    legacy = hf_config.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault("rope_type" if key == "type" else key, value)
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    if params["rope_type"] == "yarn" and hf_config.get("max_position_embeddings") is not None:
        params.setdefault("original_max_position_embeddings", hf_config["max_position_embeddings"])
    return params


def inverse_frequencies(params: dict[str, Any], rotary_dim: int) -> tuple[torch.Tensor, float]:
    """``inv_freq [rotary_dim/2]`` (float32) and the attention scaling factor for cos/sin."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return yarn_inverse_frequencies(params, rotary_dim)
    raise ConfigError(f"config.json rope_type {kind!r} is not supported (supported: default, linear, llama3, yarn)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; ``forward`` rotates q and k (``[T, heads, head_dim]``) in the
    half-split layout (``rotate_half``) that Llama-family checkpoints use; ``rotate`` rotates one tensor of
    any number of heads (a model whose q and k heads lie side by side rotates both in one pass)."""

    def __init__(self, hf_config: dict[str, Any], rotary_dim: int, max_positions: int,
                 device: torch.device | None = None) -> None:
        super().__init__()
        inv_freq, scale = inverse_frequencies(rope_parameters(hf_config), rotary_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(device), persistent=False)
        # rotate_half(x) · sin = roll(x, half) · (sin with its first half negated): the same products
        # (negation is exact), one roll instead of two slices, a negation and a cat.
        sin = emb.sin() * scale
        sin[:, : rotary_dim // 2] *= -1
        self.register_buffer("sin_signed", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, head_dim]`` rotated at ``positions [T]``."""
        return _rotate(x, *self.tables(positions))

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at ``positions [T]``, shaped ``[T, 1, rotary_dim]`` (broadcast over heads)."""
        return (self.cos.index_select(0, positions).unsqueeze(1),
                self.sin_signed.index_select(0, positions).unsqueeze(1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x · cos + rotate_half(x) · sin`` in float32, cast back to ``x``'s dtype (the sum's order does not
    change its bits)."""
    x32 = x.float()
    return x32.roll(x.shape[-1] // 2, -1).mul_(sin_signed).add_(x32 * cos).to(x.dtype)
