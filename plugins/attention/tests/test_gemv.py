"""``triton_gemv`` (``gemv.py``): the split-K GEMV equals a float64 product of the same inputs for every
row count it takes, with and without a K split, N and K off the tiles; larger inputs go to ``F.linear``;
in the engine, greedy tokens and logprobs equal the torch GEMM's.

Without a GPU the kernel runs in Triton's interpreter (the root conftest sets ``TRITON_INTERPRET=1``);
tests marked ``gpu`` check bfloat16 on CUDA at the Llama-3-8B projection shapes, and float32 at IEEE precision."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize(("n", "k"), [(70, 200), (130, 1100)])  # one slice; K split in two (split_count)
def test_gemv_equals_a_float64_product(rows: int, n: int, k: int) -> None:
    from deepinfer_attention.gemv import gemv

    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    want = (x.double() @ w.double().t()).float()
    got = gemv(x.to(DEVICE), w.to(DEVICE)).cpu()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_split_count_fills_the_device_without_short_slices() -> None:
    from deepinfer_attention.gemv import BLOCK_K, BLOCK_N, TARGET_PROGRAMS, split_count

    assert split_count(130, 1100) == 2  # 3 output tiles: as many slices as 4-step slices allow
    assert split_count(4096, 4096) == -(-TARGET_PROGRAMS // (4096 // BLOCK_N))
    assert split_count(128256, 4096) == 1  # the LM head has tiles enough
    assert split_count(64, 4 * BLOCK_K - 1) == 1


def test_backend_takes_small_inputs_and_hands_larger_ones_to_linear() -> None:
    from deepinfer_attention.gemv import MAX_ROWS, TritonGemvBackend

    backend = TritonGemvBackend()
    g = torch.Generator().manual_seed(1)
    w = backend.prepare_weight(torch.randn(40, 64, generator=g).to(DEVICE))
    bias = torch.randn(40, generator=g).to(DEVICE)
    for shape in ((2, 3, 64), (MAX_ROWS + 1, 64), (0, 64)):
        x = torch.randn(*shape, generator=g).to(DEVICE)
        got = backend.linear(x, w, bias)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, bias), rtol=1e-4, atol=1e-4)
        assert got.shape == (*shape[:-1], 40)


def test_engine_with_triton_gemv_matches_the_torch_gemm(tiny_llama: Path) -> None:
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    prompts = [[3, 9, 27, 81 % 50], [5, 6, 7]]
    runs = {}
    for gemm in ("torch", "triton_gemv"):
        llm = LLM(tiny_llama, device=DEVICE, dtype="float32", kv_cache_bytes=1 << 22, block_size=16,
                  kernels={"gemm": gemm}, plugins={"attention": {"enabled": True}})
        assert llm.engine.runner.backends["linear"].name == gemm
        runs[gemm] = [o.outputs[0] for o in llm.generate(prompts, params)]
        llm.shutdown()
    for plain, fast in zip(runs["torch"], runs["triton_gemv"], strict=True):
        assert plain.token_ids == fast.token_ids
        for a, b in zip(plain.logprobs, fast.logprobs, strict=True):
            assert a.keys() == b.keys()
            for tok in a:
                assert abs(a[tok] - b[tok]) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_gemv_bf16_on_cuda_at_llama_shapes(rows: int) -> None:
    from deepinfer_attention.gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(rows)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        x = torch.randn(rows, k, generator=g, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) / 64
        want = x.float() @ w.float().t()
        torch.testing.assert_close(gemv(x, w).float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gemv_float32_on_cuda_multiplies_in_ieee_float32() -> None:
    """float32 operands are not rounded to TF32 (``tl.dot``'s default): at K = 4096 TF32 errs by ~3e-2 on
    these sums of magnitude ~64, IEEE float32 by ~1e-4."""
    from deepinfer_attention.gemv import gemv

    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 4096, generator=g)
    w = torch.randn(1024, 4096, generator=g)
    want = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(gemv(x.cuda(), w.cuda()).cpu(), want, rtol=0, atol=2e-3)
