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
    half-split layout (``rotate_half``) that Llama-family checkpoints use."""

    def __init__(self, hf_config: dict[str, Any], rotary_dim: int, max_positions: int,
                 device: torch.device | None = None) -> None:
        super().__init__()
        inv_freq, scale = inverse_frequencies(rope_parameters(hf_config), rotary_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)
