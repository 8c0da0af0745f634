"""Gemma3ForCausalLM against transformers on tiny random configs (fp32, CPU).

Prompts run past the sliding window, so the windowed layers' masks matter; one config soft-caps the
logits and unties the head, one rewrites config.json into the legacy keys older checkpoints carry.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import assert_cached_logits_match, assert_greedy_matches_generate, randomize

from deepinfer import LLM
from deepinfer.interfaces import LayerCacheInfo

DECODE_STEPS = 16
VOCAB = 256

_BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 512,
         "num_attention_heads": 4, "rms_norm_eps": 1e-6}

# name -> Gemma3TextConfig kwargs
GEMMA3_TINY: dict[str, dict[str, object]] = {
    # Tied head, GQA 2:1, two sliding layers per global one, score scale unlike head_dim's.
    "gemma3-tied": {
        "num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "query_pre_attn_scalar": 24,
        "tie_word_embeddings": True,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    },
    # Untied head with final logit soft-capping, one KV head (like Gemma-3-270M), linear rope scaling on the
    # global layers only.
    "gemma3-softcap": {
        "num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 12,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 32, "tie_word_embeddings": False, "final_logit_softcapping": 4.0,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500_000.0}},
    },
}


def build_gemma3(name: str, seed: int = 0) -> transformers.Gemma3ForCausalLM:
    """A tiny random Gemma-3 with clear argmax margins; its norm weights sit near 0 (scale ``1 + w``)."""
    config = transformers.Gemma3TextConfig(**{**_BASE, **GEMMA3_TINY[name]})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).eval()
    randomize(model, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1 and "norm" in pname:
                p.sub_(1.0)
    return model


@pytest.fixture(scope="module", params=sorted(GEMMA3_TINY))
def tiny(request, tmp_path_factory) -> tuple[transformers.Gemma3ForCausalLM, Path]:
    model = build_gemma3(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def test_softcap_config_caps_logits():
    model = build_gemma3("gemma3-softcap")
    with torch.no_grad():
        logits = model(torch.tensor([_prompts([20], seed=0)[0]])).logits
    # The oracle really exercises the cap: raw logits would exceed it.
    assert logits.abs().max().item() > 0.5 * GEMMA3_TINY["gemma3-softcap"]["final_logit_softcapping"]
    assert logits.abs().max().item() < GEMMA3_TINY["gemma3-softcap"]["final_logit_softcapping"]


def test_sliding_layers_are_declared_to_the_replay_planner(tiny):
    model, folder = tiny
    llm = LLM(folder, kv_cache_bytes=1 << 22, block_size=16)
    infos = [spec.info() for spec in llm.engine.model.cache_specs()]
    window = model.config.sliding_window
    expected = [LayerCacheInfo(kind="sliding", window=window) if t == "sliding_attention"
                else LayerCacheInfo(kind="full") for t in model.config.layer_types]
    assert infos == expected


def test_prefill_and_cached_decode_logits_match(tiny):
    model, folder = tiny
    llm = LLM(folder, kv_cache_bytes=1 << 23, block_size=16)
    # Every prompt but the first is longer than the sliding window; decode runs further past it.
    assert_cached_logits_match(llm, model, _prompts([5, 23, 40, 17], seed=1), DECODE_STEPS)


def test_cpu_plugin_runs_gemma_layers_one_request_at_a_time(tiny):
    """With ``plugins.cpu`` (oneDNN GEMMs, ``cpu_paged`` attention) and one request at a time, every decode
    step is a one-row step the fused decode step would take for a Llama: Gemma's layers (sandwich norms, GELU,
    q/k norms) are not its form, so it declines and the logits still match transformers."""
    model, folder = tiny
    llm = LLM(folder, kv_cache_bytes=1 << 23, block_size=16, max_num_seqs=1, plugins={"cpu": {"enabled": True}})
    assert llm.engine.model.decoder_stack() is None
    assert_cached_logits_match(llm, model, _prompts([5, 23], seed=4), DECODE_STEPS)
    fused = getattr(llm.engine.runner.backends["linear"], "decode_stack", None)
    assert fused is None or fused.steps == 0


def test_chunked_prefill_logits_match(tiny):
    model, folder = tiny
    # A 16-token budget splits every long prompt into chunks that straddle the window's edge.
    llm = LLM(folder, kv_cache_bytes=1 << 23, block_size=16, max_num_batched_tokens=16)
    assert_cached_logits_match(llm, model, _prompts([37, 50, 9], seed=3), DECODE_STEPS)


def test_greedy_ids_match_generate_in_a_mixed_batch(tiny):
    model, folder = tiny
    llm = LLM(folder, kv_cache_bytes=1 << 23, block_size=16, max_num_batched_tokens=48)
    assert_greedy_matches_generate(llm, model, _prompts([3, 31, 64, 12, 47, 9], seed=2))


def test_legacy_config_keys_give_the_same_model(tmp_path):
    """Hub configs of Gemma-3 predate ``rope_parameters``/``layer_types``: ``rope_theta`` is the global
    theta, ``rope_local_base_freq`` the sliding one, and every ``sliding_window_pattern``-th layer is global."""
    model = build_gemma3("gemma3-tied")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_types"], config["rope_parameters"]
    config.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=3)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(tmp_path, kv_cache_bytes=1 << 23, block_size=16)
    assert_cached_logits_match(llm, model, _prompts([30, 11], seed=4), DECODE_STEPS)


def test_unsupported_attention_softcapping_is_refused(tmp_path):
    model = build_gemma3("gemma3-tied")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["attn_logit_softcapping"] = 50.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="attn_logit_softcapping"):
        LLM(tmp_path, kv_cache_bytes=1 << 22, block_size=16)
