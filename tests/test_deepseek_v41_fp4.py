"""DeepSeek-V4.1 with FP4 routed experts (``quantization_config.expert_dtype: fp4``) on tiny random configs:
the checkpoint's packed e2m1 bytes and ue8m0 scales load as stored, and the model equals the same model with
bf16/fp32 experts holding the dequantized weights (tolerance: exact — the dequantization is exact and the
expert math is the reference backend's); bad scales or an unknown ``expert_dtype`` fail at load naming them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from test_deepseek_v41 import _logits_by_request, build_v41, reference_tensors, v41_config, v41_llm

from deepinfer import SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.model.deepseek_v4.fp4_moe import V4Fp4MoE
from deepinfer.model.deepseek_v4.moe import V4MoE
from deepinfer.model.deepseek_v4.v41 import DeepseekV41ForCausalLM
from deepinfer.model.deepseek_v4.v41_config import V41Dims
from deepinfer.model.layers import fp4
from deepinfer.model.layers.reference_deepseek import TorchMoEBackend
from deepinfer.model.loader import init_dummy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP4 = {"expert_dtype": "fp4", "scale_fmt": "ue8m0"}


def fp4_config(**quant: object) -> dict:
    return {**v41_config(), "quantization_config": {**FP4, **quant}}


def fp4_experts(tensors: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random FP4 experts under the reference's names: ``X.weight`` int8 packed e2m1 ``[out, in/2]`` and
    ``X.scale`` F8_E8M0 ``[out, in/32]`` with scales 2^-6 .. 2^-2 for every routed expert weight ``X``."""
    out = {}
    for name, w in tensors.items():
        if ".ffn.experts." not in name:
            continue
        rows, cols = w.shape
        codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
        scales = torch.randint(121, 126, (rows, cols // 32), generator=gen, dtype=torch.uint8)
        out[name] = fp4.pack_e2m1(codes).view(torch.int8)
        out[name.removesuffix(".weight") + ".scale"] = scales.view(torch.float8_e8m0fnu)
    return out


def dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP4 checkpoint with every expert dequantized to float32 and no scales: the bf16 model's twin."""
    out = {k: v for k, v in tensors.items() if not k.endswith(".scale")}
    for name, w in tensors.items():
        if ".ffn.experts." in name and name.endswith(".weight"):
            out[name] = fp4.dequantize_e2m1(w, tensors[name.removesuffix(".weight") + ".scale"], 32,
                                            dtype=torch.float32)
    return out


def write(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``(fp4 tensors, folder of the FP4 checkpoint, folder of its dequantized twin)``."""
    root = tmp_path_factory.mktemp("v41_fp4")
    model = build_v41(root / "bf16")
    tensors = reference_tensors(model)
    tensors.update(fp4_experts(tensors, torch.Generator().manual_seed(1)))
    return (tensors, write(root / "fp4", tensors, fp4_config()),
            write(root / "dense", dequantized(tensors), v41_config()))


def load(config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
         ) -> DeepseekV41ForCausalLM:
    model = DeepseekV41ForCausalLM(config, dtype=dtype, device=torch.device("cpu"), max_positions=512)
    model.load_weights(tensors.items())
    return model


def test_experts_load_as_stored_bytes(checkpoints):
    """No float copy of the experts: each layer holds the checkpoint's bytes (uint8), 17/32 of a byte per
    weight (half a byte plus a 1/32-byte scale), about 27% of bf16."""
    tensors, _, _ = checkpoints
    model = load(fp4_config(), tensors)
    mlp = model.layers[1].mlp
    assert isinstance(mlp, V4Fp4MoE) and not hasattr(mlp, "w13") and not hasattr(mlp, "w2")
    e, inter, hidden = model.d.n_routed, model.d.moe_inter, model.d.hidden
    assert torch.equal(mlp.w13_fp4[3, inter:], tensors["layers.1.ffn.experts.3.w3.weight"].view(torch.uint8))
    assert torch.equal(mlp.w2_scale[5], tensors["layers.1.ffn.experts.5.w2.scale"].view(torch.uint8))
    stored = sum(p.numel() for n, p in mlp.named_parameters() if "_fp4" in n or "_scale" in n)
    assert all(p.dtype == torch.uint8 for n, p in mlp.named_parameters() if "_fp4" in n or "_scale" in n)
    assert stored * 32 == 3 * e * inter * hidden * 17
    assert stored / (3 * e * inter * hidden * 2) == pytest.approx(0.2656, abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_layer_equals_the_dense_layer_on_the_dequantized_weights(checkpoints, dtype):
    """One MoE layer, 40 tokens: the FP4 path (tiles dequantized per active expert) equals the reference
    backend on the dense dequantized weights, bitwise, in float32 and in bfloat16."""
    tensors, _, _ = checkpoints
    fp4_model = load(fp4_config(), tensors, dtype)
    dense_model = load(v41_config(), dequantized(tensors), dtype)
    fp4_mlp, dense_mlp = fp4_model.layers[2].mlp, dense_model.layers[2].mlp
    assert type(dense_mlp) is V4MoE
    w13, w2 = fp4_mlp.expert_tiles()
    assert torch.equal(w13.dense(), dense_mlp.w13) and torch.equal(w2.dense(), dense_mlp.w2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, fp4_model.d.hidden, generator=gen).to(dtype)
    ids = torch.randint(0, fp4_model.d.vocab, (40,), generator=gen)
    linear = SimpleNamespace(linear=lambda a, w, b=None: torch.nn.functional.linear(a, w, b))
    ctx = SimpleNamespace(backends={"experts": TorchMoEBackend(), "linear": linear}, num_real_tokens=None)
    got = fp4_mlp(x, ids, torch.arange(40), ctx)
    want = dense_mlp(x, ids, torch.arange(40), ctx)
    assert got.abs().max() > 0 and torch.equal(got, want)


def test_fp4_model_generates_as_the_dequantized_model(checkpoints):
    """Through the engine (chunked prefill, cached decode): equal logits at every step, 4 prompts."""
    _, fp4_folder, dense_folder = checkpoints
    batch = [[5 + i, 9, 17 + 2 * i, 3] * (3 + i) for i in range(4)]
    got = _logits_by_request(v41_llm(fp4_folder), batch, 6)
    want = _logits_by_request(v41_llm(dense_folder), batch, 6)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_scales_of_the_wrong_shape_fail_naming_the_tensor(checkpoints, tmp_path):
    tensors, _, _ = checkpoints
    name = "layers.3.ffn.experts.6.w1.scale"
    bad = {**tensors, name: tensors[name][:, :1].contiguous()}
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load(fp4_config(), bad)
    # a bf16 expert weight in an FP4 checkpoint: the weight's dtype is wrong
    wname = "layers.0.ffn.experts.1.w2.weight"
    dense = {**tensors, wname: torch.zeros(tensors[wname].shape, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=wname.replace(".", r"\.") + ".*dtype"):
        load(fp4_config(), dense)
    # an FP4 expert without its scale: the model's parameter is left unfilled
    missing = {k: v for k, v in tensors.items() if k != "layers.4.ffn.experts.0.w2.scale"}
    with pytest.raises(ValueError, match=r"layers\.4\.mlp\.w2_scale"):
        load(fp4_config(), missing)
    # through the engine's loader too
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        v41_llm(write(tmp_path / "bad", bad, fp4_config()))


@pytest.mark.parametrize(("quant", "field"), [
    ({"expert_dtype": "fp8"}, "quantization_config.expert_dtype"),
    ({"expert_dtype": "nvfp4"}, "quantization_config.expert_dtype"),
    ({"quant_method": "int8"}, "quantization_config.quant_method"),
    ({"scale_fmt": "e4m3"}, "quantization_config.scale_fmt"),
    ({"group_size": 16}, "quantization_config.group_size"),
])
def test_unsupported_quantization_fails_naming_the_field(checkpoints, quant, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        DeepseekV41ForCausalLM(fp4_config(**quant), dtype=torch.float32, device=torch.device("cpu"),
                               max_positions=512)


def test_dummy_weights_fill_the_stored_bytes(tmp_path):
    """``load_format=dummy``: random codes under one scale near the dummy std; the model generates."""
    (tmp_path / "config.json").write_text(json.dumps(fp4_config()))
    llm = v41_llm(tmp_path, load_format="dummy")
    outs = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4
    model = DeepseekV41ForCausalLM(fp4_config(), dtype=torch.float32, device=torch.device("cpu"), max_positions=512)
    init_dummy(model, seed=0)
    w13 = model.layers[0].mlp.expert_tiles()[0].dense()
    assert 0.01 < w13.std().item() < 0.04 and len(w13.unique()) == 15  # every value of e2m1 (±0 are one)


def test_fp4_kv_dtype_refuses_index_keys_narrower_than_a_scale_group(checkpoints):
    """``cache.kv_dtype: fp4`` stores V4.1's indexer keys as FP4_INDEX (32-value groups, kv/v41_cache.py): this
    tiny config's 16-wide keys are refused at start-up naming the setting and the format (a 32-wide config
    runs: tests/test_v41_kv_cache.py)."""
    _, fp4_folder, _ = checkpoints
    with pytest.raises(ConfigError, match=r"cache\.kv_dtype='fp4': fp4_index: 16 values a token"):
        v41_llm(fp4_folder, cache={"kv_dtype": "fp4"})


DENSE_FP8 = ("attn.wq_a.weight", "attn.wkv.weight", "attn.wq_b.weight", "attn.wo_b.weight",
             "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight")


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` → e4m3 data and ue8m0 scales ``[ceil(out/32), ceil(in/32)]``, one per 32×32 block
    (the power of two that keeps the block's amax within 448)."""
    rows, cols = w.shape
    pad = torch.nn.functional.pad(w.float(), (0, -cols % 32, 0, -rows % 32))
    amax = pad.unflatten(0, (-1, 32)).unflatten(-1, (-1, 32)).abs().amax((1, 3)).clamp_min(1e-4)
    exp = torch.ceil(torch.log2(amax / 448))
    scale = torch.exp2(exp).repeat_interleave(32, 0)[:rows].repeat_interleave(32, 1)[:, :cols]
    return (w.float() / scale).to(torch.float8_e4m3fn), (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def test_dense_fp8_weights_load_dequantized(checkpoints, tmp_path):
    """``quant_method: fp8`` with FP4 experts, as the reference's checkpoint: dense e4m3 weights with 32×32
    ue8m0 block scales load dequantized; logits equal those of the model holding the dequantized weights."""
    tensors, _, _ = checkpoints
    quantized, plain = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.split(".", 2)[-1] in DENSE_FP8]:
        data, scale = fp8_blocks(tensors[name])
        quantized[name], quantized[name.removesuffix(".weight") + ".scale"] = data, scale
        plain[name] = data.float() * fp4.ue8m0_values(scale).repeat_interleave(32, 0)[: data.shape[0]] \
            .repeat_interleave(32, 1)[:, : data.shape[1]]
    assert not torch.equal(plain["layers.1.attn.wq_b.weight"], tensors["layers.1.attn.wq_b.weight"])
    batch = [[5 + i, 9, 17 + 2 * i, 3] * 3 for i in range(2)]
    got = _logits_by_request(v41_llm(write(tmp_path / "fp8", quantized, fp4_config(quant_method="fp8"))), batch, 4)
    want = _logits_by_request(v41_llm(write(tmp_path / "plain", plain, fp4_config())), batch, 4)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    # its errors name the tensor: a scale of the wrong shape, a weight without its scale, FP8 without fp8
    bad = {**quantized, "layers.2.attn.wkv.scale": quantized["layers.2.attn.wkv.scale"][:, :1].contiguous()}
    with pytest.raises(ValueError, match=r"layers\.2\.attn\.wkv\.scale"):
        load(fp4_config(quant_method="fp8"), bad)
    lone = {k: v for k, v in quantized.items() if k != "layers.0.attn.wq_a.scale"}
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.weight.*no 'layers\.0\.attn\.wq_a\.scale'"):
        load(fp4_config(quant_method="fp8"), lone)
    with pytest.raises(ValueError, match=r"is FP8 but config\.json has no quantization_config\.quant_method"):
        load(fp4_config(), quantized)


def test_v41_shaped_layer_memory():
    """One MoE layer of ``scripts/deepseek_v41_shaped.json`` (64 experts of 4096×2048, built on the meta
    device): routed experts 0.797 GiB as FP4 against 3.0 GiB in bf16; with the bf16 gate and shared expert
    0.845 GiB against 3.048 GiB."""
    config = json.loads((Path(__file__).parent.parent / "scripts" / "deepseek_v41_shaped.json").read_text())
    config["quantization_config"] = {"expert_dtype": "fp4"}
    d = V41Dims(config)
    meta = torch.device("meta")
    fp4_layer, bf16_layer = V4Fp4MoE(d, 1, "moe", torch.bfloat16, meta), V4MoE(d, 1, "moe", torch.bfloat16, meta)

    def gib(params: list[torch.Tensor]) -> float:
        return sum(p.numel() * p.element_size() for p in params) / 2 ** 30

    routed = [fp4_layer.w13_fp4, fp4_layer.w13_scale, fp4_layer.w2_fp4, fp4_layer.w2_scale]
    assert gib(routed) == 0.796875 and gib([bf16_layer.w13, bf16_layer.w2]) == 3.0
    assert round(gib(list(fp4_layer.parameters())), 3) == 0.845
    assert round(gib(list(bf16_layer.parameters())), 3) == 3.048
