"""Penalties, biases and teacher forcing under speculative decoding: verification applies the penalties
to the target at every verified position, and a draft equal to the forced (golden) token is accepted."""

from __future__ import annotations

from spec_setup import repeating_prompts, spec_plugins, write_oracle_file
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams


def _ids(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_penalized_tokens_are_the_same_with_and_without_drafts(tmp_path):
    """Greedy verification is exact match against the penalized target, row by row (drafts before a
    row counted): the tokens equal those of a run without speculation, and drafts do get accepted."""
    folder = save_tiny("llama", tmp_path / "m")[1]
    prompts = repeating_prompts(6, seed=13)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.4 * (i % 3),
                             presence_penalty=0.3, repetition_penalty=1.0 + 0.2 * (i % 2), logit_bias={7: 2.0})
              for i in range(len(prompts))]
    plain = LLM(folder, kv_cache_bytes=1 << 23, block_size=16)
    want = _ids(plain, prompts, params)
    plain.shutdown()
    oracle = write_oracle_file(tmp_path, prompts, want)
    for drafter, extra in (("ngram", {}), ("oracle", {"oracle_file": oracle, "oracle_corruption": 0.3})):
        llm = LLM(folder, kv_cache_bytes=1 << 23, block_size=16, plugins=spec_plugins(drafter, "fixed", **extra))
        assert _ids(llm, prompts, params) == want, drafter
        spec = llm.get_stats()["spec_decode"]
        assert spec["verify_steps"] > 0
        if drafter == "oracle":
            assert spec["mean_acceptance_length"] > 1.5, spec
        llm.shutdown()


def test_drafts_equal_to_golden_tokens_are_accepted(tmp_path):
    folder = save_tiny("llama", tmp_path / "m")[1]
    prompts = [[3, 4, 5, 6], [10, 11, 12]]
    golden = [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [9, 9, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4]]
    oracle = write_oracle_file(tmp_path, prompts, golden)
    llm = LLM(folder, kv_cache_bytes=1 << 23, block_size=16,
              plugins=spec_plugins("oracle", "fixed", oracle_file=oracle, oracle_corruption=0.25))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True, golden_token_ids=g)
              for i, g in enumerate(golden)]
    outs = _ids(llm, prompts, params)
    for out, g in zip(outs, golden, strict=True):
        assert out[:12] == g and len(out) == 16
    spec = llm.get_stats()["spec_decode"]
    # the model itself would almost never sample these sequences: acceptance comes from the golden rule
    assert spec["mean_acceptance_length"] > 2.0, spec
    llm.shutdown()
