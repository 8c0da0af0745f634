"""GPU checks for the lead's H200 runs (``-m gpu``): the Triton kernels compiled for real (bf16 and FP8)
and DeepGEMM (when ``deep_gemm`` imports) against the float32 reference on a DeepSeek-V2-Lite-shaped
layer (64 experts, top-6, hidden 2048, width 1408), with skewed and empty-expert routing and ragged
token counts on both layouts, plus CUDA-graph capture and replay with new routing; the FP4 experts
(DeepSeek-V4.1's stored e2m1 bytes, ``experts_fp4``) against the reference on the same dequantized weights,
eager and replayed from a graph."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from moe_cases import ROUTINGS, make_problem, make_routing, reference, relative_error

from deepinfer.ops import TorchMoEBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

V2_LITE = {"experts": 64, "top_k": 6, "hidden": 2048, "inter": 1408}
TOKENS = (1, 3, 16, 200, 1000)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_triton_bf16_matches_reference(tokens: int, routing: str) -> None:
    from deepinfer_moe.triton_backend import TritonMoEBackend

    p = make_problem(tokens, **V2_LITE, routing=routing, seed=tokens, device="cuda", dtype=torch.bfloat16)
    backend = TritonMoEBackend()
    out = backend.experts(p.x, p.topk_ids, p.topk_weights, backend.prepare_experts(p.w13, p.w2))
    assert relative_error(out, reference(p)) < 1e-2


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_triton_fp8_matches_reference(tokens: int, routing: str) -> None:
    from deepinfer_moe.triton_backend import TritonMoEBackend

    p = make_problem(tokens, **V2_LITE, routing=routing, seed=tokens, device="cuda", dtype=torch.bfloat16)
    backend = TritonMoEBackend(fp8=True)
    prepared = backend.prepare_experts(p.w13, p.w2)
    out = backend.experts(p.x, p.topk_ids, p.topk_weights, prepared)
    w13, w2 = prepared.dequantize()
    # Against the reference on the FP8 weights the remaining error is activation quantization only.
    assert relative_error(out, reference(p, w13, w2)) < 0.05
    assert relative_error(out, reference(p)) < 0.08


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("tokens", [2, 64])
def test_triton_captures_in_a_cuda_graph_and_replays_new_routing(tokens: int, kind: str) -> None:
    """bf16, FP8 and FP4 (``experts_fp4``) experts replay a captured graph with new routing as eagerly."""
    from deepinfer_moe.triton_backend import TritonMoEBackend

    p = make_problem(tokens, **V2_LITE, routing="uniform", seed=5, device="cuda", dtype=torch.bfloat16)
    backend = TritonMoEBackend(fp8=kind == "fp8")
    if kind == "fp4":
        weights, _ = _fp4(p)
        run = backend.experts_fp4
    else:
        weights, run = backend.prepare_experts(p.w13, p.w2), backend.experts
    x, ids, w = p.x.clone(), p.topk_ids.clone(), p.topk_weights.clone()
    run(x, ids, w, weights)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, ids, w, weights)
    new_ids, new_w = make_routing(tokens, V2_LITE["experts"], V2_LITE["top_k"], "skewed", seed=6, device="cuda")
    ids.copy_(new_ids)
    w.copy_(new_w)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, run(x, ids, w, weights), rtol=0, atol=0)


def _deep_gemm():
    from deepinfer_moe.deepgemm_backend import DeepGemmMoEBackend

    backend = DeepGemmMoEBackend(masked_max_tokens=64, warmup_tokens=())
    if not backend.available():
        pytest.skip("deep_gemm does not import on this machine (needs deepinfer-gemm on SM90/SM100)")
    return backend


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 16, 64, 65, 1000])  # masked up to 64, contiguous above
def test_deep_gemm_matches_reference(tokens: int, routing: str) -> None:
    backend = _deep_gemm()
    p = make_problem(tokens, **V2_LITE, routing=routing, seed=tokens, device="cuda", dtype=torch.bfloat16)
    prepared = backend.prepare_experts(p.w13, p.w2)
    out = backend.experts(p.x, p.topk_ids, p.topk_weights, prepared)
    w13, w2 = prepared.dequantize()
    assert relative_error(out, reference(p, w13, w2)) < 0.05
    assert relative_error(out, reference(p)) < 0.08


def test_deep_gemm_masked_layout_captures_in_a_cuda_graph() -> None:
    backend = _deep_gemm()
    p = make_problem(8, **V2_LITE, routing="uniform", seed=3, device="cuda", dtype=torch.bfloat16)
    weights = backend.prepare_experts(p.w13, p.w2)
    x, ids, w = p.x.clone(), p.topk_ids.clone(), p.topk_weights.clone()
    backend.experts(x, ids, w, weights)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.experts(x, ids, w, weights)
    new_ids, _ = make_routing(8, V2_LITE["experts"], V2_LITE["top_k"], "skewed", seed=4, device="cuda")
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, backend.experts(x, ids, w, weights), rtol=0, atol=0)


def test_deep_gemm_warm_up_compiles_at_prepare() -> None:
    from deepinfer_moe.deepgemm_backend import DeepGemmMoEBackend

    _deep_gemm()
    backend = DeepGemmMoEBackend(warmup_tokens=(1, 300))
    p = make_problem(4, **V2_LITE, routing="uniform", seed=1, device="cuda", dtype=torch.bfloat16)
    prepared = backend.prepare_experts(p.w13, p.w2)
    assert len(backend._warm) == 1
    assert relative_error(backend.experts(p.x, p.topk_ids, p.topk_weights, prepared), reference(p)) < 0.08


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(5, 64, 6), (16, 64, 6), (64, 64, 6), (16, 256, 8)])
def test_sort_free_layout_equals_the_torch_layout_on_cuda(tokens: int, experts: int, top_k: int, routing: str) -> None:
    from deepinfer_moe.layout import sorted_blocks
    from deepinfer_moe.layout_kernel import small_sorted_blocks

    ids, _ = make_routing(tokens, experts, top_k, routing, seed=tokens, device="cuda")
    for block_m in (16, 32, 64):
        expected = sorted_blocks(ids, experts, block_m)
        layout = small_sorted_blocks(ids, experts, block_m)
        assert torch.equal(layout.pairs, expected.pairs) and torch.equal(layout.block_expert, expected.block_expert)


@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_sort_free_and_torch_layouts_give_the_same_experts_output(tokens: int) -> None:
    from deepinfer_moe.triton_backend import TritonMoEBackend

    p = make_problem(tokens, **V2_LITE, routing="uniform", seed=tokens, device="cuda", dtype=torch.bfloat16)
    new, old = TritonMoEBackend(), TritonMoEBackend(sort_free_layout=False)
    out = new.experts(p.x, p.topk_ids, p.topk_weights, new.prepare_experts(p.w13, p.w2))
    torch.testing.assert_close(out, old.experts(p.x, p.topk_ids, p.topk_weights, (p.w13, p.w2)), rtol=0, atol=0)
    assert relative_error(out, reference(p)) < 1e-2


def test_fused_router_and_experts_capture_in_a_cuda_graph() -> None:
    """Router kernel, sort-free layout, both GEMMs and the pair sum replay with new logits."""
    from deepinfer_moe.triton_backend import TritonMoEBackend

    from deepinfer.interfaces import RoutingSpec

    tokens = 16
    p = make_problem(tokens, **V2_LITE, routing="uniform", seed=8, device="cuda", dtype=torch.bfloat16)
    backend = TritonMoEBackend()
    weights = backend.prepare_experts(p.w13, p.w2)
    spec = RoutingSpec(top_k=V2_LITE["top_k"], method="balanced", normalize=True, layer=2)
    logits = torch.randn(tokens, V2_LITE["experts"], device="cuda")
    positions = torch.arange(100, 100 + tokens, device="cuda")

    def step() -> torch.Tensor:
        ids, w = backend.select_experts(logits, None, positions, spec)
        return backend.experts(p.x, ids, w, weights)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    logits.normal_()
    positions += 7
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, step(), rtol=0, atol=0)


def _fp4(p, swiglu_limit: float | None = None):
    """``p``'s experts stored as FP4 (``quantize_e2m1``: ue8m0 per 32) and the float64 reference on them."""
    from deepinfer.interfaces import Fp4ExpertWeights
    from deepinfer.model.layers.fp4 import dequantize_e2m1, quantize_e2m1

    (q13, s13), (q2, s2) = quantize_e2m1(p.w13), quantize_e2m1(p.w2)
    weights = Fp4ExpertWeights(q13, s13, q2, s2, 32)
    # float64: on CUDA a float32 reference could itself run reduced-precision (TF32) GEMMs
    w13, w2 = (dequantize_e2m1(q, s, 32, dtype=torch.float64) for q, s in ((q13, s13), (q2, s2)))
    want = TorchMoEBackend().experts(p.x.double(), p.topk_ids, p.topk_weights, (w13, w2), swiglu_limit=swiglu_limit)
    return weights, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_triton_fp4_matches_reference_on_the_dequantized_weights(tokens: int, routing: str,
                                                                 dtype: torch.dtype) -> None:
    """Activations times tiles dequantized in registers against the float32 reference on the same (exactly
    dequantized) weights, both layouts, with V4.1's clamped SwiGLU: bf16 within its rounding, float32
    (IEEE products) within float32 rounding."""
    from deepinfer_moe.triton_backend import TritonMoEBackend

    p = make_problem(tokens, **V2_LITE, routing=routing, seed=tokens, device="cuda", dtype=dtype)
    weights, want = _fp4(p, swiglu_limit=10.0)
    out = TritonMoEBackend().experts_fp4(p.x, p.topk_ids, p.topk_weights, weights, swiglu_limit=10.0)
    assert out is not None and out.dtype == dtype
    assert relative_error(out, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
