"""``triton_bi`` (op ``experts``): the GPU MoE backend of ``kernels.batch_invariant`` (reference/
deepinfer.md §9): a token's output is bitwise the same alone or in any batch.

The pairs (token, top-k slot) are laid out expert-sorted in 16-row blocks (``layout.sorted_blocks``;
never the decode layout, whose choice follows the token count) and multiplied by
``batch_invariant_kernels.grouped_matmul``, whose tiles are constant and whose K loop runs in order, so a
pair's row does not depend on how many pairs its expert got. SwiGLU and the routing weight are
element-wise torch ops in float32 between and after the two GEMMs; the combine adds a token's ``k``
rows in top-k slot order, one element-wise add per slot (a torch reduction over the slots could choose
its order from the number of outputs).

Cost against ``triton``: SwiGLU is not fused (the ``[P, 2I]`` gate/up product goes through memory), the
sort runs at decode too, and large prefills keep 16-row blocks instead of 32/64, so each expert weight
tile is read more often (README.md, "Batch invariance").

Under ``TRITON_INTERPRET=1`` it also declares the CPU device, ranking below the core's CPU
batch-invariant backend, so CPU ``auto`` is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.interfaces import BackendCapabilities
from deepinfer.testing import triton_interpreting
from deepinfer_moe.layout import sorted_blocks
from deepinfer_moe.triton_backend import contiguous_experts, triton_importable

_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


def invariant_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, *, swiglu_limit: float | None = None) -> torch.Tensor:
    """``Σ_j topk_weights[t, j] · expert_{ids[t, j]}(x[t])`` ``[T, H]`` in ``x.dtype``, each token's bits
    independent of the other tokens. ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` contiguous."""
    from deepinfer_moe.batch_invariant_kernels import BLOCK_M, grouped_matmul  # imports triton

    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return x.new_zeros(0, x.shape[1])
    inter = w2.shape[2]
    layout = sorted_blocks(topk_ids, w13.shape[0], BLOCK_M)
    gate, up = grouped_matmul(x.contiguous(), w13, layout, top_k).float().split(inter, dim=-1)
    if swiglu_limit is not None:
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
    h = (F.silu(gate) * up).to(x.dtype)
    per_pair = grouped_matmul(h, w2, layout, 1).float() * topk_weights.reshape(-1, 1).float()
    per_pair = per_pair.view(tokens, top_k, x.shape[1])
    out = per_pair[:, 0]
    for j in range(1, top_k):
        out = out + per_pair[:, j]
    return out.to(x.dtype)


class TritonBIMoEBackend:
    """Op ``experts`` through ``invariant_experts``."""

    name = "triton_bi"
    ops = frozenset({"experts"})

    def __init__(self) -> None:
        interpret = triton_interpreting()
        # Below every default backend (torch is 0): declaring batch_invariant also fits runs without the
        # mode, which must not pick it. On CUDA no other MoE backend declares the capability; under the
        # interpreter it also ranks below the core's CPU batch-invariant backend (-10).
        self.priority = -20 if interpret else -5
        self.capabilities = BackendCapabilities(
            devices=frozenset({"cuda", "cpu"}) if interpret else frozenset({"cuda"}),
            dtypes=_DTYPES, graph_safe=True, batch_invariant=True, varlen=True)

    def available(self) -> bool:
        return triton_importable() and (torch.cuda.is_available() or triton_interpreting())

    def prepare_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> Any:
        """The parameters themselves, made contiguous in place if another backend re-laid them out."""
        return contiguous_experts(w13, w2)

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                weights: Any, *, swiglu_limit: float | None = None) -> torch.Tensor:
        """The ``MoEBackend`` contract; ``weights`` is ``(w13, w2)``."""
        w13, w2 = weights
        return invariant_experts(x, topk_ids, topk_weights, w13.contiguous(), w2.contiguous(),
                                 swiglu_limit=swiglu_limit)
