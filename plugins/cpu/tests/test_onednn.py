"""The ``onednn`` GEMM backend: equal to a float64 product for any row count, packed once and repacked
after an in-place write, chosen by ``kernels.gemm: auto`` on CPU, and a real model's logits and greedy
ids unchanged with it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from deepinfer_cpu.onednn import OneDNNGemmBackend, onednn_available
from deepinfer_cpu.paged_attention import compiler
from tiny_models import assert_cached_logits_match, record_logits, save_tiny

from deepinfer import LLM, SamplingParams

pytestmark = [pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN"),
              pytest.mark.usefixtures("one_torch_thread")]


def _weight(out: int, inp: int, seed: int) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(out, inp, generator=gen), requires_grad=False)


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_a_float64_product(rows: int, with_bias: bool) -> None:
    backend = OneDNNGemmBackend()
    weight = _weight(96, 40, rows)
    weight.data = backend.prepare_weight(weight.data)
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 40, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    got = backend.linear(x, weight, bias)
    ref = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_leading_dimensions_and_lazily_packed_parameters() -> None:
    backend = OneDNNGemmBackend()
    weight = _weight(24, 16, 1)  # never prepared: packed on first use (a tied LM head)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(2))  # 16 rows: oneDNN's
    got = backend.linear(x, weight)
    assert got.shape == (2, 8, 24)
    torch.testing.assert_close(got, x @ weight.t(), rtol=1e-5, atol=1e-5)
    assert len(backend._packed) == 1
    backend.linear(x, weight)
    assert len(backend._packed) == 1  # the packed copy is reused


def test_an_in_place_write_repacks_and_temporaries_are_never_packed() -> None:
    backend = OneDNNGemmBackend()
    weight = _weight(32, 8, 3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    backend.linear(x, weight)
    with torch.no_grad():
        weight.mul_(2.0)
    torch.testing.assert_close(backend.linear(x, weight), x @ weight.t(), rtol=1e-5, atol=1e-5)
    temporary = torch.randn(32, 8)
    torch.testing.assert_close(backend.linear(x, temporary), x @ temporary.t(), rtol=1e-5, atol=1e-5)
    assert all(entry.weight.data_ptr() != temporary.data_ptr() for entry in backend._packed.values())


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def test_auto_takes_onednn_on_cpu_and_logits_match_transformers(tiny_llama) -> None:
    model, folder = tiny_llama
    llm = LLM(folder, block_size=16, kv_cache_bytes=1 << 22, plugins={"cpu": {"enabled": True}})
    assert llm.engine.runner.backends["linear"].name == "onednn"
    assert llm.engine.runner.backends["paged_attention"].name == ("cpu_paged" if compiler() else "torch")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (3, 11, 20)]
    assert_cached_logits_match(llm, model, prompts, decode_steps=8)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no AVX512-BF16-class CPU")
def test_bfloat16_end_to_end_logits_within_bf16_tolerance(tiny_llama) -> None:
    """``model.dtype=bfloat16`` on CPU (oneDNN's bf16 GEMMs, the core's attention): every step's logits
    (prefill and cached decode) within bf16 rounding of float32 transformers on the same weights — no further
    from it than transformers' own bfloat16 run, with a margin, and within 8 bf16 steps of the largest logit."""
    model, folder = tiny_llama
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    llm = LLM(folder, dtype="bfloat16", block_size=16, kv_cache_bytes=1 << 22, plugins={"cpu": {"enabled": True}})
    assert llm.engine.runner.backends["linear"].name == "onednn"
    steps = record_logits(llm)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (4, 13)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    rows: dict[str, list[torch.Tensor]] = {}
    for ids, logits in steps:
        for rid, row in zip(ids, logits, strict=True):
            rows.setdefault(rid, []).append(row)
    for prompt, out in zip(prompts, outs, strict=True):
        ours = torch.stack(rows[out.request_id])
        full = torch.tensor([prompt + out.outputs[0].token_ids[:6]])
        with torch.no_grad():
            ref = model(full).logits[0, len(prompt) - 1:]
            theirs = model_bf16(full).logits[0, len(prompt) - 1:].float()
        step = 2 ** -8 * ref.abs().max().item()  # bf16 keeps 8 significant bits
        err, their_err = (ours - ref).abs(), (theirs - ref).abs()
        assert err.max().item() <= 8 * step
        assert err.mean().item() <= 2 * their_err.mean().item() + step / 4
    llm.shutdown()


def test_the_varlen_cost_curve_is_profiled_on_both_sides_of_the_gemv_rows(tmp_path: Path) -> None:
    """``row_breaks``: a step of ``min_rows − 1`` rows runs the GEMV (and the fused step), one of ``min_rows``
    oneDNN; the step-cost curve of ``varlen`` is profiled at both, besides the powers of two."""
    _, folder = save_tiny("llama", tmp_path)
    llm = LLM(folder, block_size=16, kv_cache_bytes=1 << 22, max_num_seqs=4,
              plugins={"cpu": {"enabled": True, "min_rows": 6},
                       "spec_decode": {"enabled": True, "drafter": "ngram", "plan": "varlen", "max_draft": 3}})
    assert llm.engine.runner.backends["linear"].row_breaks(torch.float32) == [5]
    sizes = llm.engine.speculator.cost.sizes
    assert {1, 2, 4, 5, 6, 8, 16} <= set(sizes) and sizes == sorted(sizes) and max(sizes) == 16  # 4 requests x 4
    llm.shutdown()
