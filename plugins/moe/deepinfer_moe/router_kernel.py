"""The DeepSeek router after its gate GEMM in one Triton launch: ``select_experts`` of the ``triton``
backends (``interfaces.MoEBackend``), equal to the reference ``deepinfer.model.layers.routing.route``.

One program per token row holds the row's ``E`` logits as a ``[groups, experts per group]`` tile
(padded to powers of two) and does, in registers: scores (sigmoid or softmax), the choice (score +
correction bias for ``noaux_tc``; the balanced draw's SplitMix64 hash of (position, layer, expert)),
the group limit (each group's score: the sum of its two best, or its best; keep ``topk_group``
groups), ``k`` rounds of arg-max (ties to the lower expert id), and the weights: the chosen
experts' scores, renormalized and scaled. That replaces the sigmoid/add/top-k (two sort kernels per
``topk``)/gather/sum/divide/multiply launches of the torch router with one.

``router_fits`` is the capability check: up to ``MAX_EXPERTS`` experts, ``k ≤ MAX_TOP_K``, at least
two experts per group, and kept groups that hold ``k`` experts; anything else goes to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.interfaces import RoutingSpec

MAX_EXPERTS = 256
MAX_TOP_K = 16
_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2, "balanced": 3}
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX2 = tl.constexpr(0x94D049BB133111EB)
_DRAW_MASK = tl.constexpr((1 << 62) - 1)


def router_fits(spec: RoutingSpec, num_experts: int) -> bool:
    """Whether the fused router serves ``spec`` over ``num_experts`` experts (else: the reference)."""
    groups = spec.n_group if spec.method in ("noaux_tc", "group_limited_greedy") else 1
    if num_experts > MAX_EXPERTS or not 0 < spec.top_k <= min(MAX_TOP_K, num_experts) or num_experts % groups:
        return False
    per_group = num_experts // groups
    return groups == 1 or (per_group >= 2 and spec.topk_group * per_group >= spec.top_k)


@triton.jit
def _splitmix64(x):
    """SplitMix64 on uint64 lanes (wrapping), as ``deepinfer.sampling.rng.splitmix64`` on int64."""
    z = x + _GOLDEN
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    return z ^ (z >> 31)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, positions_ptr, ids_ptr, weights_ptr,
    stride_l, per_group, scaling, layer,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr,
    SOFTMAX: tl.constexpr, METHOD: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
):
    """One token row: ``k`` experts and weights (see the module docstring). METHOD: 0 greedy,
    1 group_limited_greedy, 2 noaux_tc, 3 balanced."""
    row = tl.program_id(0)
    group = tl.arange(0, BLOCK_G)[:, None]
    member = tl.arange(0, BLOCK_EG)[None, :]
    expert = group * per_group + member  # [BLOCK_G, BLOCK_EG]
    valid = (group < N_GROUP) & (member < per_group)
    logit = tl.load(logits_ptr + row.to(tl.int64) * stride_l + expert, mask=valid, other=float("-inf"))
    if SOFTMAX:
        shifted = tl.exp(logit - tl.max(tl.max(logit, axis=1), axis=0))
        scores = shifted / tl.sum(tl.sum(shifted, axis=1), axis=0)
    else:
        scores = tl.sigmoid(logit)
    scores = tl.where(valid, scores, 0.0)
    if METHOD == 3:  # balanced: draws in [0, 2^62), so -1 marks invalid and taken experts
        pos = tl.load(positions_ptr + row).to(tl.int64)
        key = _splitmix64((pos * 65536 + layer).to(tl.uint64, bitcast=True))
        draws = _splitmix64(key + expert.to(tl.uint64)).to(tl.int64, bitcast=True) & _DRAW_MASK
        choice = tl.where(valid, draws, -1)
        floor = -1
        taken = -1
    else:
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + expert, mask=valid, other=0.0)
        floor = float("-inf")
        taken = float("-inf")
        if METHOD == 1:
            floor = 0.0  # V2: the experts of dropped groups score 0, and invalid lanes go below them
        choice = tl.where(valid, choice, float("-inf"))
        if N_GROUP > 1:
            best = tl.max(choice, axis=1)  # [BLOCK_G]
            if METHOD == 2:  # noaux_tc: a group's score is the sum of its two best (one copy of the best removed)
                first = tl.min(tl.where(choice == best[:, None], member, BLOCK_EG), axis=1)
                second = tl.max(tl.where(member == first[:, None], float("-inf"), choice), axis=1)
                best = best + second
            gid = tl.arange(0, BLOCK_G)
            group_score = tl.where(gid < N_GROUP, best, float("-inf"))
            kept = gid < 0
            for _ in tl.static_range(TOPK_GROUP):
                top = tl.max(group_score, axis=0)
                at = tl.min(tl.where(group_score == top, gid, BLOCK_G), axis=0)
                kept = kept | (gid == at)
                group_score = tl.where(gid == at, float("-inf"), group_score)
            choice = tl.where(kept[:, None], choice, floor)
            choice = tl.where(valid, choice, float("-inf"))
            if METHOD == 1:
                scores = tl.where(kept[:, None], scores, 0.0)  # V2's weights come from the masked scores
    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    big = BLOCK_G * BLOCK_EG
    for j in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        at = tl.min(tl.min(tl.where(valid & (choice == top), expert, big), axis=1), axis=0)
        hit = expert == at
        weight = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        ids = tl.where(slot == j, at.to(tl.int64), ids)
        weights = tl.where(slot == j, weight, weights)
        choice = tl.where(hit, taken, choice)
    if NORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scaling
    out = row.to(tl.int64) * TOP_K + slot
    tl.store(ids_ptr + out, ids, mask=slot < TOP_K)
    tl.store(weights_ptr + out, weights, mask=slot < TOP_K)


def select_experts(logits: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                   spec: RoutingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids [T, k] int64, topk_weights [T, k] float32)`` from ``logits [T, E]`` float32 in one
    launch; the caller checked ``router_fits(spec, E)``."""
    tokens, num_experts = logits.shape
    ids = torch.empty(tokens, spec.top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, spec.top_k, dtype=torch.float32, device=logits.device)
    if tokens == 0:
        return ids, weights
    logits = logits.float()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    grouped = spec.method in ("noaux_tc", "group_limited_greedy") and spec.n_group > 1
    groups = spec.n_group if grouped else 1
    per_group = num_experts // groups
    has_bias = bias is not None and spec.method == "noaux_tc"
    _route_kernel[(tokens,)](
        logits, bias.float() if has_bias else logits, logits if positions is None else positions, ids, weights,
        logits.stride(0), per_group, float(spec.scaling), int(spec.layer),
        N_GROUP=groups, TOPK_GROUP=spec.topk_group if grouped else 1, TOP_K=spec.top_k,
        BLOCK_G=triton.next_power_of_2(groups), BLOCK_EG=triton.next_power_of_2(per_group),
        BLOCK_K=triton.next_power_of_2(spec.top_k), SOFTMAX=spec.scoring == "softmax",
        METHOD=_METHODS[spec.method], HAS_BIAS=has_bias, NORMALIZE=spec.normalize,
        num_warps=4 if num_experts > 64 else 2,
    )
    return ids, weights
