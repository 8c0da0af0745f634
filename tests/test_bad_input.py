"""Bad input gets a clear error naming the field, and the engine keeps serving."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError, ModelNotFoundError


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = save_tiny("llama", tmp_path_factory.mktemp("bad"))[1]
    return LLM(folder, kv_cache_bytes=1 << 22, block_size=16, max_model_len=64)


def _still_serves(llm) -> None:
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize(("prompts", "message"), [
    ([[]], "prompt is empty"),
    ([[1] * 64], "max_model_len=64"),
    ([[1, 2, 999]], r"prompt token 2 is 999, outside the vocabulary \[0, 256\)"),
    ([[1, -1]], "outside the vocabulary"),
    ([[1, 2], []], "prompt is empty"),
    ("hello", "no tokenizer"),
])
def test_bad_prompts_fail_before_anything_is_queued(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    _still_serves(llm)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"min_p": 2}, "min_p"),
    ({"top_k": -5}, "top_k"),
    ({"logprobs": -1}, "logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**kwargs)


def test_stop_token_outside_vocab(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    _still_serves(llm)


def test_unknown_model_path_or_alias(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM("no-such-model")
    with pytest.raises(ModelNotFoundError, match=str(tmp_path)):
        LLM(tmp_path)


def test_unknown_config_key(llm):
    with pytest.raises(ConfigError, match=r"scheduler\.max_num_sequences: unknown config key"):
        LLM(llm.engine.model_path, scheduler={"max_num_sequences": 4})
    with pytest.raises(ConfigError, match=r"cache\.block_size"):
        LLM(llm.engine.model_path, block_size=0)


def test_tokenizerless_folder_generates_from_ids(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 4
