"""A verification plan offered by a third-party plugin is used when selected in config."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams

pytest.importorskip("deepinfer_spec_decode")


def test_a_third_party_plan_is_used_when_selected(install_plugin, tmp_path):
    install_plugin("deepinfer-one-draft", {"one_draft_plan": "deepinfer_one_draft_plan"})
    import deepinfer_one_draft_plan as third

    folder = save_tiny("llama", tmp_path / "m")[1]
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8, 1, 4, 4, 6]]
    params = SamplingParams(temperature=0, max_tokens=10)
    plain = LLM(folder, block_size=16)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    oracle = tmp_path / "oracle.jsonl"
    oracle.write_text("\n".join(json.dumps({"token_ids": p + r}) for p, r in zip(prompts, reference, strict=True)))
    llm = LLM(folder, block_size=16, plugins={
        "one_draft_plan": {"enabled": True},
        "spec_decode": {"enabled": True, "drafter": "oracle", "plan": "one_draft", "oracle_file": str(oracle)}})
    third.CALLS.clear()
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out == reference
    assert third.CALLS and all(total == 2 * 2 for total in third.CALLS[:1])
    spec = llm.get_stats()["spec_decode"]
    assert spec["verify_steps"] > 0 and spec["acceptance_per_position"][1:] == [0.0] * 4  # never a second draft
