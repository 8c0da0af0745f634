"""The DeepSeek-style MoE router after its gate GEMM, in plain torch: the reference and the fallback of a
MoE backend's fused ``select_experts`` (``interfaces.MoEBackend``), and the oracle of its tests.

``route(logits, bias, positions, spec)`` turns float32 gate logits ``[T, E]`` into ``topk_ids [T, k]``
(int64) and ``topk_weights [T, k]`` (float32) as ``RoutingSpec`` describes. The balanced draw hashes
(position, layer, expert) with SplitMix64 and keeps the ``k`` largest draws, so it does not depend on
the batch; under it the router's own choice is never computed (only its scores, for the weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.interfaces import RoutingSpec
from deepinfer.sampling.rng import splitmix64

ROW_ALIGN = 64  # elements: whole vectors of float32 and bf16 at any CPU vector width torch uses
DRAW_MASK = (1 << 62) - 1  # balanced draws keep 62 bits: non-negative, so −1 marks "taken" in a kernel


def balanced_draws(positions: torch.Tensor, layer: int, num_experts: int) -> torch.Tensor:
    """``[T, E]`` int64 draws in ``[0, 2^62)``: ``splitmix64(splitmix64(position·65536 + layer) + e)``."""
    experts = torch.arange(num_experts, device=positions.device)
    key = splitmix64(positions.to(torch.int64) * 65536 + layer)
    return splitmix64(key.unsqueeze(1) + experts) & DRAW_MASK


def row_sigmoid(logits: torch.Tensor) -> torch.Tensor:
    """``logits.sigmoid()`` with each row's values the same bits whatever the number of rows. torch's CPU
    kernel runs one vector loop over the flattened tensor and a scalar loop over its last elements, whose
    results may differ in the last bit from the vector loop's, so in a contiguous ``[T, E]`` an element's
    value depended on ``T`` (measured on an Intel Xeon: the batch-invariant V3 test failed). On CPU the rows
    are padded to a multiple of ``ROW_ALIGN`` elements, so no element takes the scalar loop."""
    width = logits.shape[-1]
    if logits.device.type != "cpu" or width % ROW_ALIGN == 0:
        return logits.sigmoid()
    return F.pad(logits, (0, -width % ROW_ALIGN)).sigmoid()[..., :width]


def route(logits: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
          spec: RoutingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids [T, k] int64, topk_weights [T, k] float32)`` from ``logits [T, E]`` float32; ``bias
    [E]`` (``noaux_tc`` only, may be None) and ``positions [T]`` (``balanced`` only)."""
    t, e, g = logits.shape[0], logits.shape[1], spec.n_group
    scores = row_sigmoid(logits) if spec.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores
    if spec.method == "balanced":
        ids = balanced_draws(positions, spec.layer, e).topk(spec.top_k, dim=-1).indices
    elif spec.method == "noaux_tc":
        choice = scores if bias is None else scores + bias
        if g > 1:
            group_scores = choice.view(t, g, e // g).topk(2, dim=-1).values.sum(dim=-1)
            choice = choice.masked_fill(~_group_mask(group_scores, spec.topk_group, e), float("-inf"))
        ids = choice.topk(spec.top_k, dim=-1).indices
    else:
        if spec.method == "group_limited_greedy" and g > 1:
            group_scores = scores.view(t, g, e // g).amax(dim=-1)
            choice = scores.masked_fill(~_group_mask(group_scores, spec.topk_group, e), 0.0)
        ids = choice.topk(spec.top_k, dim=-1).indices
    weights = choice.gather(1, ids) if spec.method in ("greedy", "group_limited_greedy") else scores.gather(1, ids)
    if spec.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * spec.scaling


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """``[T, E]`` True for the experts of each token's ``topk_group`` best groups."""
    keep = group_scores.topk(topk_group, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return mask.repeat_interleave(num_experts // group_scores.shape[1], dim=1)
