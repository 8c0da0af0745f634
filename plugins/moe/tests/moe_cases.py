"""Random MoE problems and the fp32 oracle shared by the tests and ``scripts/bench_moe.py``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer_moe.fp8 import BLOCK

from deepinfer.ops import TorchMoEBackend

ROUTINGS = ("uniform", "skewed", "empty_experts")


@dataclass
class Problem:
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor


def make_weights(experts: int, hidden: int, inter: int, *, seed: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [E, 2I, H]``, ``w2 [E, H, I]`` scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def make_routing(tokens: int, experts: int, top_k: int, routing: str, *, seed: int,
                 device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids [T, k] int64, topk_weights [T, k] float32)``: distinct experts per token.

    ``skewed``: experts 0..k have a large score bonus, so most tokens pick the same few experts;
    ``empty_experts``: only the even experts can be chosen (needs ``k <= E / 2``)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    if routing == "skewed":
        scores[:, : top_k + 1] += 0.9
    elif routing == "empty_experts":
        scores[:, 1::2] = -1.0
    elif routing != "uniform":
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return ids.to(device), weights.to(device)


def make_problem(tokens: int, experts: int, top_k: int, hidden: int, inter: int, routing: str, *, seed: int,
                 device: str = "cpu", dtype: torch.dtype = torch.float32) -> Problem:
    w13, w2 = make_weights(experts, hidden, inter, seed=seed, device=device, dtype=dtype)
    ids, weights = make_routing(tokens, experts, top_k, routing, seed=seed + 1, device=device)
    gen = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    return Problem(x, ids, weights, w13, w2)


def reference(p: Problem, w13: torch.Tensor | None = None, w2: torch.Tensor | None = None,
              x: torch.Tensor | None = None, swiglu_limit: float | None = None) -> torch.Tensor:
    """The core's reference MoE in float32 (optionally on other weights or inputs, e.g. dequantized)."""
    w13 = p.w13 if w13 is None else w13
    w2 = p.w2 if w2 is None else w2
    x = p.x if x is None else x
    return TorchMoEBackend().experts(x.float(), p.topk_ids, p.topk_weights, (w13.float(), w2.float()),
                                     swiglu_limit=swiglu_limit)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float32."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, group: int = BLOCK,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``deepinfer_moe.fp8.quantize_rows`` (``q [M, K]`` · its group's scale, in ``dtype``): the
    activations the FP8 kernels multiply, for the oracle and the round-trip test."""
    k = q.shape[-1]
    return (q.float() * scale.repeat_interleave(group, dim=-1)[..., :k]).to(dtype)
