"""Each CPU-runnable backend against the core's reference MoE in float32 on fresh random problems:
uniform, skewed and empty-expert routing, ragged token counts (decode and prefill layouts), bf16
and FP8 tolerances. The Triton kernels run through Triton's interpreter here (``conftest.py``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_moe.fp8 import Fp8Experts, quantize_rows
from deepinfer_moe.grouped import GroupedMoEBackend
from moe_cases import ROUTINGS, dequantize_rows, make_problem, reference, relative_error

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install deepinfer-moe[test])")

# E experts, top-k, hidden, intermediate: small, with sizes that are not multiples of the tiles.
SHAPE = {"experts": 8, "top_k": 3, "hidden": 96, "inter": 80}
TOKENS = (1, 3, 5, 37)  # 1 and 3: the Triton decode layout (<= 4 tokens); 5 and 37: the sorted one
# The interpreter is slow: each routing at a decode size and at a prefill size.
TRITON_CASES = [(1, "uniform"), (3, "skewed"), (5, "empty_experts"), (37, "uniform"), (37, "skewed"),
                (37, "empty_experts")]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_grouped_matches_reference_fp32(routing: str, tokens: int) -> None:
    p = make_problem(tokens, **SHAPE, routing=routing, seed=100 + tokens)
    backend = GroupedMoEBackend()
    ref = reference(p)
    out = backend.experts(p.x, p.topk_ids, p.topk_weights, backend.prepare_experts(p.w13.clone(), p.w2.clone()))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_grouped_bf16_and_swiglu_limit() -> None:
    p = make_problem(23, **SHAPE, routing="skewed", seed=7, dtype=torch.bfloat16)
    backend = GroupedMoEBackend()
    weights = backend.prepare_experts(p.w13.clone(), p.w2.clone())
    assert relative_error(backend.experts(p.x, p.topk_ids, p.topk_weights, weights), reference(p)) < 1e-2
    limited = backend.experts(p.x, p.topk_ids, p.topk_weights, weights, swiglu_limit=0.5)
    ref_limited = reference(p, swiglu_limit=0.5)
    assert relative_error(limited, ref_limited) < 1e-2
    assert relative_error(ref_limited, reference(p)) > 0.05  # the limit really bites at this scale


def test_grouped_prepare_keeps_shape_and_values_column_major() -> None:
    p = make_problem(2, **SHAPE, routing="uniform", seed=8)
    w13 = torch.nn.Parameter(p.w13.clone())
    w2 = torch.nn.Parameter(p.w2.clone())
    GroupedMoEBackend().prepare_experts(w13, w2)
    assert torch.equal(w13, p.w13) and torch.equal(w2, p.w2)
    assert w13[0].t().is_contiguous() and w2[0].t().is_contiguous()


@needs_triton
@pytest.mark.parametrize(("tokens", "routing"), TRITON_CASES)
def test_triton_matches_reference_fp32(tokens: int, routing: str) -> None:
    from deepinfer_moe.triton_backend import TritonMoEBackend

    p = make_problem(tokens, **SHAPE, routing=routing, seed=200 + tokens)
    backend = TritonMoEBackend()
    out = backend.experts(p.x, p.topk_ids, p.topk_weights, backend.prepare_experts(p.w13, p.w2))
    torch.testing.assert_close(out, reference(p), rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("tokens", (2, 17))
def test_triton_bf16_within_bf16_tolerance(tokens: int) -> None:
    from deepinfer_moe.triton_backend import TritonMoEBackend

    p = make_problem(tokens, **SHAPE, routing="skewed", seed=300 + tokens, dtype=torch.bfloat16)
    backend = TritonMoEBackend()
    out = backend.experts(p.x, p.topk_ids, p.topk_weights, backend.prepare_experts(p.w13, p.w2))
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference(p)) < 1e-2
    limited = backend.experts(p.x, p.topk_ids, p.topk_weights, (p.w13, p.w2), swiglu_limit=0.5)
    assert relative_error(limited, reference(p, swiglu_limit=0.5)) < 1e-2


@needs_triton
@pytest.mark.parametrize(("tokens", "routing"), [(1, "uniform"), (20, "skewed"), (20, "empty_experts")])
def test_triton_fp8_matches_an_exact_emulation_and_the_fp32_reference(tokens: int, routing: str) -> None:
    """Against a float32 emulation of the same quantization (weights dequantized from the FP8 copy,
    activations and the SwiGLU output quantized per token and 128 channels) the kernels must agree to
    float32 accuracy; against the unquantized reference, within FP8's error."""
    from deepinfer_moe.triton_backend import TritonMoEBackend

    shape = {"experts": 8, "top_k": 3, "hidden": 256, "inter": 192}  # several 128-wide scale tiles
    p = make_problem(tokens, **shape, routing=routing, seed=400 + tokens)
    backend = TritonMoEBackend(fp8=True)
    prepared = backend.prepare_experts(p.w13, p.w2)
    assert isinstance(prepared, Fp8Experts)
    out = backend.experts(p.x, p.topk_ids, p.topk_weights, prepared)

    w13, w2 = prepared.dequantize()
    x_q = dequantize_rows(*quantize_rows(p.x))
    inter = shape["inter"]
    emulated = torch.zeros_like(out)
    for t in range(tokens):  # the oracle: one token at a time, no layout at all
        for j in range(shape["top_k"]):
            e = int(p.topk_ids[t, j])
            gate_up = w13[e] @ x_q[t]
            h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            h_q = dequantize_rows(*quantize_rows(h.unsqueeze(0)))[0]
            emulated[t] += p.topk_weights[t, j] * (w2[e] @ h_q)
    # Not bit-exact: a float32 summation-order difference can move a value of h across an e4m3
    # rounding boundary (one FP8 step on that element); still ~50x below the quantization error.
    assert relative_error(out, emulated) < 1e-3
    assert relative_error(out, reference(p)) < 0.08


@needs_triton
def test_triton_fp8_refuses_unprepared_weights() -> None:
    from deepinfer_moe.triton_backend import TritonMoEBackend

    p = make_problem(2, **SHAPE, routing="uniform", seed=9)
    with pytest.raises(TypeError, match="prepare_experts"):
        TritonMoEBackend(fp8=True).experts(p.x, p.topk_ids, p.topk_weights, (p.w13, p.w2))
