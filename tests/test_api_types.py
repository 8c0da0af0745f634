"""Offline API arguments of the wrong type (issue 24): a ``ValueError`` naming the argument, never a raw
``TypeError``/``AttributeError`` from deep inside, and nothing queued."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_tok_dir):
    with LLM(tiny_llama_tok_dir, kv_cache_bytes=1 << 21, block_size=16) as llm:
        yield llm


def _nothing_queued(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_waiting"] == stats["num_running"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize(("prompts", "message"), [
    (b"hello", r"prompts must be .* got bytes \(bytes are not taken as token ids"),
    (bytearray(b"hi"), "got bytearray"),
    ([b"hello"], r"prompts\[0\] must be a str or a list of token ids, got bytes"),
    (5, "prompts must be .* got int"),
    (None, "prompts must be .* got NoneType"),
    (2.5, "prompts must be .* got float"),
    (["ok", None], r"prompts\[1\] .* got NoneType"),
    (["ok", 3.5], r"prompts\[1\] .* got float"),
    ({"prompt": "hi"}, "got dict"),
])
def test_prompts_of_the_wrong_type(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    _nothing_queued(llm)


@pytest.mark.parametrize(("params", "message"), [
    ({"max_tokens": 4}, r"sampling_params must be a SamplingParams or a list of them, got dict \(build one"),
    ("greedy", "got str"),
    ([GREEDY, {"max_tokens": 4}], r"sampling_params\[1\] must be a SamplingParams, got dict"),
])
def test_params_of_the_wrong_type(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["a", "b"], params, use_tqdm=False)
    _nothing_queued(llm)


def test_stop_none_means_no_stop_strings():
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop="x").stop == ["x"]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"stop": 5}, "stop"), ({"stop": [None]}, "stop"), ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_sampling_params_fields_of_the_wrong_type(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("messages", "kwargs", "message"), [
    (None, None, "messages must be a non-empty list"),
    ("hi", None, "messages must be a non-empty list"),
    ([], None, "messages must be a non-empty list"),
    ([[{"role": "user", "content": "hi"}], "x"], None, "messages: conversation 1"),
    ([{"role": "user", "content": "hi"}], ["thinking"], "chat_template_kwargs must be a mapping"),
    ([{"role": "user", "content": "hi"}], {"messages": []}, r"chat_template_kwargs: \['messages'\]"),
])
def test_chat_arguments_of_the_wrong_type(llm, messages, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs=kwargs)
    _nothing_queued(llm)


def test_good_calls_still_work(llm):
    assert len(llm.generate(("a", [1, 2, 3]), [GREEDY, GREEDY], use_tqdm=False)) == 2
    assert llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
