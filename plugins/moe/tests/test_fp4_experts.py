"""FP4 experts through the Triton kernels (``TritonMoEBackend.experts_fp4``; DeepSeek-V4.1's ``expert_dtype:
fp4``), on CPU through Triton's interpreter: the kernels' tile dequantization equals the core's
``dequantize_e2m1`` bit for bit on every byte of codes and every scale byte; the op equals the reference
experts on the dequantized weights (decode and sorted layouts, the clamped SwiGLU); ``triton_fp8`` and
devices the kernels do not run on decline, so the model's reference path runs."""

from __future__ import annotations

import pytest
import torch
from deepinfer_moe.triton_backend import TritonMoEBackend, triton_importable
from moe_cases import make_routing

from deepinfer.interfaces import Fp4ExpertWeights
from deepinfer.ops import TorchMoEBackend, dequantize_e2m1

pytestmark = pytest.mark.skipif(not triton_importable(), reason="needs triton")

BLOCK = 32


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # scale 2^127 · 6: ±inf
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_tiles_dequantize_every_code_and_scale_exactly(device: str) -> None:
    """Row r has every scale byte r (0: the subnormal 2^-127; 254: overflow to ±inf for codes above 1; 255:
    NaN) and its 256 bytes are every pair of codes: the kernel's values equal the core's, NaN for NaN."""
    from deepinfer_moe.triton_kernels import dequantize_fp4

    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # [256, 256] → 512 values a row
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 512 // BLOCK)
    got = dequantize_fp4(packed.to(device), scales.to(device), BLOCK).cpu()
    want = dequantize_e2m1(packed, scales, BLOCK, dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got[:255]), torch.signbit(want[:255]))  # -0.0 for code 8, too


def _fp4_experts(experts: int, hidden: int, inter: int, seed: int) -> Fp4ExpertWeights:
    gen = torch.Generator().manual_seed(seed)

    def stored(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, dtype=torch.uint8)
        # scales near 1/sqrt(cols) so activations stay O(1): e2m1 values have a std of about 2.9
        scale = torch.randint(121, 125, (experts, rows, cols // BLOCK), generator=gen, dtype=torch.uint8)
        return packed, scale

    w13, w13_scale = stored(2 * inter, hidden)
    w2, w2_scale = stored(hidden, inter)
    return Fp4ExpertWeights(w13, w13_scale, w2, w2_scale, BLOCK)


@pytest.mark.parametrize("tokens", [3, 37])  # the one-pair-per-block decode layout; the sorted layout
@pytest.mark.parametrize("limit", [None, 7.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_experts_equal_the_reference_on_the_dequantized_weights(tokens: int, limit: float | None,
                                                                    dtype: torch.dtype) -> None:
    experts, hidden, inter, top_k = 6, 64, 96, 2
    weights = _fp4_experts(experts, hidden, inter, seed=tokens)
    ids, routing = make_routing(tokens, experts, top_k, "uniform", seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    backend = TritonMoEBackend()
    got = backend.experts_fp4(x, ids, routing, weights, swiglu_limit=limit)
    dense = (dequantize_e2m1(weights.w13, weights.w13_scale, BLOCK, dtype=torch.float64),
             dequantize_e2m1(weights.w2, weights.w2_scale, BLOCK, dtype=torch.float64))
    want = TorchMoEBackend().experts(x.double(), ids, routing, dense, swiglu_limit=limit)
    assert got is not None and got.dtype == dtype and got.shape == want.shape and want.abs().max() > 0.1
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    else:  # bf16: the intermediate and the output rounded to 8 bits, errors up to ~2^-7 of the largest value
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_triton_fp8_and_unserved_devices_decline() -> None:
    weights = _fp4_experts(2, 32, 32, seed=0)
    ids, routing = make_routing(2, 2, 1, "uniform", seed=0)
    x = torch.randn(2, 32)
    assert TritonMoEBackend(fp8=True).experts_fp4(x, ids, routing, weights) is None
    backend = TritonMoEBackend()
    backend.interpret = False  # as on a machine without the interpreter: CPU tensors are not served
    assert backend.experts_fp4(x, ids, routing, weights) is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_a_v41_model_with_fp4_experts_generates_as_the_reference_through_the_kernels(tmp_path, monkeypatch,
                                                                                     device: str) -> None:
    """A tiny DeepSeek-V4.1 with FP4 experts (``expert_dtype: fp4``) through the engine with ``kernels.moe:
    triton`` (every MoE layer's experts read as stored by the kernels; compiled for real on CUDA, the
    interpreter on CPU): each step's logits within float32 rounding of the model's reference path
    (``kernels.moe: auto``, one expert dequantized at a time), greedy tokens equal."""
    from test_deepseek_v41 import _logits_by_request, build_v41, reference_tensors, v41_llm
    from test_deepseek_v41_fp4 import fp4_config, fp4_experts, write

    tensors = reference_tensors(build_v41(tmp_path / "bf16"))
    tensors.update(fp4_experts(tensors, torch.Generator().manual_seed(1)))
    folder = write(tmp_path / "fp4", tensors, fp4_config())
    batch = [[5 + i, 9, 17 + 2 * i, 3] * (2 + i) for i in range(3)]
    calls = []
    served = TritonMoEBackend.experts_fp4
    monkeypatch.setattr(TritonMoEBackend, "experts_fp4", lambda *a, **k: calls.append(1) or served(*a, **k))
    # float32 on both devices (``model.dtype: auto`` is bf16 on a GPU, whose rounding the tolerance is not for)
    kernel_llm = v41_llm(folder, kernels={"moe": "triton"}, plugins={"moe": {"enabled": True}}, device=device,
                         dtype="float32")
    assert kernel_llm.engine.runner.backends["experts"].name == "triton"
    got = _logits_by_request(kernel_llm, batch, 4)
    assert calls  # every MoE layer of every step
    want = _logits_by_request(v41_llm(folder, device=device, dtype="float32"), batch, 4)
    for g, w in zip(got, want, strict=True):
        assert g.argmax(-1).tolist() == w.argmax(-1).tolist()
        steps = [(round((a - b).abs().max().item(), 6), round(b.abs().max().item(), 3))
                 for a, b in zip(g, w, strict=True)]
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, s=steps: f"{m}\n(max diff, max|logit|) by step: {s}")
