"""The plugin inside the engine: discovery and selection by ``kernels.moe``, a tiny DeepSeek-V3 giving
the reference's greedy tokens through ``grouped`` (and through the Triton kernels under the
interpreter), and an FP8 checkpoint (``weight_scale_inv``) loading into the same model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers
from deepinfer_moe.fp8 import dequantize_weight_blocks, quantize_weight_blocks
from deepinfer_moe.grouped import GroupedMoEBackend
from safetensors.torch import load_file, save_file
from tiny_models import randomize

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.ops import TorchMoEBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256
# DeepSeek-V3 with 8 routed experts, top-2 over 2 groups, one shared expert, two MoE layers.
TINY_V3 = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
           "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
           "qk_nope_head_dim": 16, "v_head_dim": 16, "max_position_embeddings": 256,
           "num_nextn_predict_layers": 0}
PROMPTS = [[5, 9, 77, 3], list(range(10, 41)), [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
ENGINE = {"kv_cache_bytes": 1 << 22, "block_size": 16}
MOE_ON = {"moe": {"enabled": True}}


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-v3-moe")
    config = transformers.DeepseekV3Config(**TINY_V3)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    randomize(model, gen)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    model.save_pretrained(folder)
    return folder


def greedy(folder: Path, max_tokens: int = 12, **overrides: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(folder, **ENGINE, **overrides)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_auto_picks_grouped_on_cpu_and_gives_the_reference_tokens(tiny_v3: Path) -> None:
    ref_tokens, ref_llm = greedy(tiny_v3)
    assert isinstance(ref_llm.engine.runner.backends["experts"], TorchMoEBackend)
    ref_llm.shutdown()
    tokens, llm = greedy(tiny_v3, plugins=MOE_ON)
    moe = llm.engine.model.layers[1].mlp
    assert isinstance(llm.engine.runner.backends["experts"], GroupedMoEBackend)
    assert moe.w13[0].t().is_contiguous()  # prepare_experts ran: column-major experts
    llm.shutdown()
    assert tokens == ref_tokens
    named, llm = greedy(tiny_v3, plugins=MOE_ON, kernels={"moe": "grouped"})
    llm.shutdown()
    assert named == ref_tokens


def test_naming_a_backend_that_cannot_serve_fails_at_start(tiny_v3: Path) -> None:
    with pytest.raises(ConfigError, match="deep_gemm"):
        LLM(tiny_v3, **ENGINE, plugins=MOE_ON, kernels={"moe": "deep_gemm"})


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_in_the_engine_give_the_reference_tokens(tiny_v3: Path) -> None:
    """Through Triton's interpreter on CPU (slow, so few tokens), or compiled on a GPU machine."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref_tokens, llm = greedy(tiny_v3, max_tokens=4, device=device, dtype="float32")
    llm.shutdown()
    tokens, llm = greedy(tiny_v3, max_tokens=4, device=device, dtype="float32", plugins=MOE_ON,
                         kernels={"moe": "triton"})
    assert llm.engine.runner.backends["experts"].name == "triton"
    llm.shutdown()
    assert tokens == ref_tokens


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("balanced", [False, True])
def test_fused_router_gives_the_torch_routers_tokens(tiny_v3: Path, balanced: bool) -> None:
    """The triton backend's ``select_experts`` (on by default) against the model's torch router
    (``plugins.moe.fused_router: false``), with the real router and under forced balanced routing."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs = []
    for fused in (True, False):
        plugins = {"moe": {"enabled": True, "fused_router": fused}}
        tokens, llm = greedy(tiny_v3, max_tokens=4, device=device, dtype="float32", plugins=plugins,
                             kernels={"moe": "triton", "force_balanced_routing": balanced})
        moe = llm.engine.model.layers[1].mlp
        routed = llm.engine.runner.backends["experts"].select_experts(
            torch.randn(3, 8, device=device), moe.e_score_correction_bias, torch.arange(3, device=device), moe.routing)
        assert (routed is not None) == fused
        llm.shutdown()
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_fp8_checkpoint_with_weight_scale_inv_loads_dequantized(tiny_v3: Path, tmp_path: Path) -> None:
    """Every ``*_proj.weight`` matrix saved as e4m3 + ``weight_scale_inv`` (128×128 tiles, as
    DeepSeek-V3 ships): the model's parameters must hold the dequantized values."""
    for path in tiny_v3.iterdir():
        if path.suffix != ".safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(tiny_v3 / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight") and tensor.dim() == 2:
            q, scale = quantize_weight_blocks(tensor)
            fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")] = q, scale
            expected[name] = dequantize_weight_blocks(q, scale)
        else:
            fp8[name] = tensor
    save_file(fp8, str(tmp_path / "model.safetensors"))
    llm = LLM(tmp_path, **ENGINE)
    model = llm.engine.model
    torch.testing.assert_close(model.layers[1].mlp.w2[3], expected["model.layers.1.mlp.experts.3.down_proj.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(model.layers[0].self_attn.o_weight, expected["model.layers.0.self_attn.o_proj.weight"],
                               rtol=0, atol=0)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    assert len(out[0].outputs[0].token_ids) == 3
