"""The ``triton_bi`` MoE backend: a token's output is bitwise the same alone and among other tokens
(other counts per expert, other places in its expert's block), and close to the torch reference.

Without a GPU the kernel runs in Triton's interpreter (``conftest.py``); the shapes are tiny but an
expert's rows span several 16-row blocks and K is not a multiple of the 64-wide tile."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from deepinfer.interfaces import RunRequirements
from deepinfer.model.layers.reference_deepseek import sorted_experts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXPERTS, HIDDEN, INTER, TOP_K = 4, 80, 48, 2


def _weights(gen: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = 0.2 * torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen)
    w2 = 0.2 * torch.randn(EXPERTS, HIDDEN, INTER, generator=gen)
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


@pytest.mark.parametrize("swiglu_limit", [None, 0.5])
def test_token_alone_equals_token_in_any_batch(swiglu_limit: float | None) -> None:
    from deepinfer_moe.batch_invariant import invariant_experts

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    w13, w2 = _weights(gen, dtype)
    token = torch.randn(1, HIDDEN, generator=gen).to(DEVICE, dtype)
    ids = torch.tensor([[2, 0]], device=DEVICE)
    weights = torch.tensor([[0.7, 0.3]], device=DEVICE)
    alone = invariant_experts(token, ids, weights, w13, w2, swiglu_limit=swiglu_limit)
    # (batch size, target row): expert 2 gets 1, 3, 20 and 40 rows (up to three 16-row blocks)
    for size, at in ((2, 1), (5, 0), (20, 13), (40, 37)):
        x = torch.randn(size, HIDDEN, generator=gen).to(DEVICE, dtype)
        batch_ids = torch.stack([torch.full((size,), 2), torch.randint(0, 2, (size,), generator=gen)], 1).to(DEVICE)
        batch_weights = torch.rand(size, TOP_K, generator=gen).to(DEVICE)
        x[at], batch_ids[at], batch_weights[at] = token[0], ids[0], weights[0]
        out = invariant_experts(x, batch_ids, batch_weights, w13, w2, swiglu_limit=swiglu_limit)
        assert torch.equal(out[at], alone[0]), (size, at)
    expected = sorted_experts(token, ids, weights, (w13, w2), swiglu_limit, F.linear)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone, expected, rtol=tol, atol=tol)


def test_backend_declares_the_capability_and_ranks_below_the_defaults() -> None:
    from deepinfer_moe.batch_invariant import TritonBIMoEBackend

    backend = TritonBIMoEBackend()
    req = RunRequirements(device=DEVICE, dtype=torch.bfloat16, kv_dtype="auto", graph_safe=True, batch_invariant=True)
    assert backend.available() and req.missing(backend.capabilities) == []
    assert backend.priority < 0  # below the default backends: a run without the mode never picks it
    if DEVICE == "cpu":  # interpreter: below the core's CPU batch-invariant backend (-10)
        assert backend.priority < -10
