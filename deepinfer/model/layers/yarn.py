"""YaRN rope scaling (Peng et al. 2023) as transformers 5 computes it, and DeepSeek's softmax mscale.

``yarn_inverse_frequencies`` blends interpolated (``/ factor``) and original frequencies with a linear
ramp between the dimensions that rotate ``beta_fast`` and ``beta_slow`` times over the original
context, and returns the factor cos/sin are multiplied by (``attention_factor``; by default
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are given, else
``mscale(factor)``). ``yarn_softmax_scale`` is MLA's softmax scale: ``qk_head_dim**-0.5`` times
``mscale(factor, mscale_all_dim)**2`` when the rope is scaled and ``mscale_all_dim`` is set.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from deepinfer.errors import ConfigError


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 · mscale · ln(scale) + 1`` for ``scale > 1``, else 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, original_len: int) -> float:
    """The (fractional) rotary dimension whose wavelength fits ``rotations`` times in ``original_len``."""
    return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inverse_frequencies(params: dict[str, Any], rotary_dim: int) -> tuple[torch.Tensor, float]:
    """``inv_freq [rotary_dim/2]`` (float32) and the cos/sin factor for ``rope_type: yarn``."""
    if params.get("factor") is None or params.get("original_max_position_embeddings") is None:
        raise ConfigError("config.json rope_type 'yarn' needs 'factor' and 'original_max_position_embeddings'")
    base = float(params["rope_theta"])
    factor = float(params["factor"])
    original_len = int(params["original_max_position_embeddings"])
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)
    low = _correction_dim(beta_fast, rotary_dim, base, original_len)
    high = _correction_dim(beta_slow, rotary_dim, base, original_len)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency (high-frequency dims), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(params: dict[str, Any], qk_head_dim: int) -> float:
    """MLA's softmax scale: ``qk_head_dim**-0.5``, times ``mscale(factor, mscale_all_dim)**2`` for a
    scaled rope with ``mscale_all_dim`` set (as DeepSeek-V2/V3 and transformers do)."""
    scale = qk_head_dim ** -0.5
    mscale_all_dim = params.get("mscale_all_dim")
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        m = yarn_mscale(float(params["factor"]), float(mscale_all_dim))
        scale *= m * m
    return scale
