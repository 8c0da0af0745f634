"""Tiny random transformers models saved as HF folders: the oracles for the model code."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from deepinfer import SamplingParams

# Every architecture the core supports, as (config class, model class, config kwargs).
TINY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied-llama3rope": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}

BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "tie_word_embeddings": False}


def build_tiny(name: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny random model with weights large enough that greedy argmax margins are clear;
    ``overrides`` change config fields (e.g. ``vocab_size``)."""
    cfg_cls, model_cls, extra = TINY[name]
    config = getattr(transformers, cfg_cls)(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    randomize(model, torch.Generator().manual_seed(seed + 1))
    return model


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm scales near 1, every other parameter N(0, 0.15²): logits spread enough for clear argmax."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1 and "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def save_tiny(name: str, folder: Path, seed: int = 0, **overrides: object) -> tuple[torch.nn.Module, Path]:
    model = build_tiny(name, seed, **overrides)
    model.save_pretrained(folder)
    return model, folder


def record_logits(llm) -> list[tuple[list[str], torch.Tensor]]:
    """Patch an LLM so every step's sampled-row logits are kept with the request ids of the rows."""
    steps: list[tuple[list[str], torch.Tensor]] = []
    runner, model = llm.engine.runner, llm.engine.model
    prepare, compute = runner.prepare, model.compute_logits
    pending: list[list[str]] = []

    def prepare_and_note(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        pending.append([s.request_id for s in inputs.samplers])
        return inputs

    def compute_and_keep(hidden, ctx):
        logits = compute(hidden, ctx)
        steps.append((pending.pop(), logits.clone()))
        return logits

    runner.prepare = prepare_and_note
    model.compute_logits = compute_and_keep
    return steps


def assert_cached_logits_match(llm, model: torch.nn.Module, prompts: list[list[int]], decode_steps: int) -> None:
    """Greedy-generate ``decode_steps + 1`` tokens per prompt with ``llm`` and check every step's
    logits (prefill, then each cached decode step) against the transformers ``model`` run on the
    whole sequence: within 1e-4 × max|logit|."""
    from deepinfer import SamplingParams

    steps = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True),
                        use_tqdm=False)
    per_request: dict[str, list[torch.Tensor]] = {}
    for ids, logits in steps:
        for rid, row in zip(ids, logits, strict=True):
            per_request.setdefault(rid, []).append(row)
    for prompt, out in zip(prompts, outs, strict=True):
        ours = torch.stack(per_request[out.request_id])  # [1 + decode_steps, V]
        assert ours.shape[0] == decode_steps + 1
        full = torch.tensor([prompt + out.outputs[0].token_ids[:decode_steps]])
        with torch.no_grad():
            ref = model(full).logits[0, len(prompt) - 1:]
        err = (ours - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), f"max |Δ| {err}"


def assert_greedy_matches_generate(llm, model: torch.nn.Module, prompts: list[list[int]], max_tokens: int = 24) -> None:
    """Greedy ids of ``prompts`` generated together by ``llm`` equal transformers' ``generate`` on each
    prompt alone (both stop at EOS)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()
