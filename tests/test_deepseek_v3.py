"""DeepSeek-V3/V2 (MLA + MoE) against transformers on tiny random configs (fp32, CPU), and the MoE
reference backend against a per-token loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from tiny_models import assert_cached_logits_match, randomize

from deepinfer import LLM, SamplingParams
from deepinfer.model.layers import routing
from deepinfer.model.layers.reference_deepseek import TorchMoEBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256
DECODE_STEPS = 32
BLOCK = 16
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
V3_BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
           "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
           "qk_nope_head_dim": 16, "v_head_dim": 16, "max_position_embeddings": 256, "rope_parameters": YARN,
           "num_nextn_predict_layers": 1}

# name -> (config class, model class, config kwargs, rewrite config.json in the legacy rope form)
CONFIGS = {
    # oracles.md §1a: q_lora, YaRN with mscale, interleaved rope, noaux_tc over 2 groups.
    "v3-yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {}, False),
    # No q_lora (q_proj), plain rope in the half-split layout, 4 groups keep 2, top-3, no normalization,
    # two shared experts, every layer MoE.
    "v3-noqlora": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "q_lora_rank": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_interleave": False, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
        "norm_topk_prob": False, "n_shared_experts": 2, "first_k_dense_replace": 0,
        "routed_scaling_factor": 1.5}, False),
    # Published-config form: rope_theta + rope_scaling{type: yarn}, mscale != mscale_all_dim (so cos/sin
    # carry an attention factor), no rope_interleave/head_dim keys; an MTP layer's tensors on disk.
    "v3-legacy": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0,
                            "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
                            "mscale": 0.707, "mscale_all_dim": 1.0}}, True),
    # V2: softmax routing, group_limited_greedy (group score = max), YaRN as V2 ships it.
    "v2-grouped": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
        "routed_scaling_factor": 2.0, "q_lora_rank": None,
        "rope_parameters": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}}, False),
    # V2 greedy top-k with q_lora.
    "v2-greedy": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "topk_method": "greedy", "n_group": None, "topk_group": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, False),
}


def _build(name: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    cfg_cls, model_cls, extra, legacy = CONFIGS[name]
    config = getattr(transformers, cfg_cls)(**{**V3_BASE, **extra})
    if cfg_cls == "DeepseekV2Config":
        config.num_nextn_predict_layers = 0
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    randomize(model, gen)
    with torch.no_grad():
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(folder)
    if legacy:
        path = folder / "config.json"
        raw = json.loads(path.read_text())
        rope = raw.pop("rope_parameters")
        for key in ("rope_interleave", "head_dim", "qk_head_dim"):
            raw.pop(key, None)
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
        path.write_text(json.dumps(raw))
        n = config.num_hidden_layers  # an incomplete MTP layer past the last layer: dropped with a warning
        save_file({f"model.layers.{n}.enorm.weight": torch.ones(64),
                   f"model.layers.{n}.eh_proj.weight": torch.zeros(64, 128)}, str(folder / "mtp.safetensors"))
    return model


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


MIXED = _prompts([3, 31, 64, 12, 47, 9], seed=2)
_SYSTEM = _prompts([40], seed=3)[0]  # 2+ full blocks shared by the conversations
CONVERSATIONS = [_SYSTEM + tail for tail in _prompts([3, 17, 9], seed=4)]
MAX_NEW = 24




@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return _build(request.param, folder), folder


def _greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_transformers_greedy(model, prompts, ids):
    """Each of our greedy ids is transformers' argmax given the tokens before it (teacher-forced, one
    forward per prompt: the same verdict as ``generate`` without its per-token cost), and a sequence
    shorter than ``MAX_NEW`` ended at EOS."""
    eos = model.config.eos_token_id
    for prompt, out in zip(prompts, ids, strict=True):
        assert out, "no tokens generated"
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
        assert logits.argmax(-1).tolist() == out
        assert len(out) == MAX_NEW or out[-1] == eos


def test_prefill_and_cached_decode_logits_match(tiny):
    model, folder = tiny
    # max_num_batched_tokens 32: the 40-token prompt is prefilled in two chunks (the second attends
    # to latents already in the cache).
    llm = LLM(folder, kv_cache_bytes=1 << 22, block_size=BLOCK, max_num_batched_tokens=32)
    assert_cached_logits_match(llm, model, _prompts([5, 23, 40, 17], seed=1), DECODE_STEPS)


def test_greedy_ids_match_transformers_in_a_mixed_batch(tiny):
    model, folder = tiny
    llm = LLM(folder, kv_cache_bytes=1 << 22, block_size=BLOCK, max_num_batched_tokens=48)
    _assert_transformers_greedy(model, MIXED, _greedy(llm, MIXED))


def test_greedy_ids_survive_preemption(tiny):
    model, folder = tiny
    hf = json.loads((folder / "config.json").read_text())
    per_block = hf["num_hidden_layers"] * BLOCK * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * 4
    llm = LLM(folder, kv_cache_bytes=per_block * 12, block_size=BLOCK, max_model_len=128,
              max_num_batched_tokens=64)
    _assert_transformers_greedy(model, MIXED, _greedy(llm, MIXED))
    assert llm.get_stats()["preemptions"] > 0


def test_greedy_ids_survive_prefix_cache_hits(tiny):
    model, folder = tiny
    llm = LLM(folder, kv_cache_bytes=1 << 22, block_size=BLOCK)
    first = _greedy(llm, CONVERSATIONS[:1])
    rest = _greedy(llm, CONVERSATIONS[1:])
    _assert_transformers_greedy(model, CONVERSATIONS, first + rest)
    assert llm.get_stats()["prefix_cache_hit_rate"] > 0.4  # 64 of 149 looked-up tokens


def test_moe_backend_matches_a_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, k = 40, 16, 8, 6, 2
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    # Skewed: most tokens go to expert 0, a few to 3 and 2; experts 1, 4, 5 get nothing.
    first = torch.where(torch.rand(tokens, generator=gen) < 0.8, 0, 3)
    second = torch.where(first == 0, 3, 2)
    second[:5] = 2
    ids = torch.stack([first, second], dim=1)
    weights = torch.rand(tokens, k, generator=gen)
    out = TorchMoEBackend().experts(x, ids, weights, (w13, w2))
    ref = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(k):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).split(inter)
            ref[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    empty = TorchMoEBackend().experts(x[:0], ids[:0], weights[:0], (w13, w2))
    assert empty.shape == (0, hidden)


def test_force_balanced_routing_is_uniform_and_batch_invariant(tmp_path):
    _build("v3-yarn", tmp_path)
    llm = LLM(tmp_path, kv_cache_bytes=1 << 22, block_size=BLOCK, kernels={"force_balanced_routing": True})
    moe = llm.engine.model.layers[1].mlp
    ids, _ = routing.route(torch.zeros(8000, 8), None, torch.arange(8000), moe.routing)
    assert all(len(set(row)) == 2 for row in ids.tolist())
    counts = torch.bincount(ids.reshape(-1), minlength=8).float()
    assert (counts - counts.mean()).abs().max() < 0.05 * counts.mean()
    prompts = _prompts([7, 30, 19], seed=5)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone
