"""``deepinfer serve`` with ``tokenizer="deepseek-v4"``: ``/v1/chat/completions`` encodes messages with
deepseek-recipe's V4 encoding, exactly as ``LLM.chat`` does (a tiny dummy V4 model with the real
vocabulary, an in-process server, the official ``openai`` client; CPU, seconds)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from test_deepseek_text import DUMMY_V4, THINK, USER
from test_server import ServerThread

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.async_llm import AsyncLLM
from deepinfer.server.app import create_app

pytestmark = pytest.mark.usefixtures("clean_deepinfer_env", "one_torch_thread")

ENGINE = {"tokenizer": "deepseek-v4", "load_format": "dummy", "seed": 7, "max_num_seqs": 4,
          "cache": {"kv_cache_bytes": 1 << 22, "block_size": 16}}
NAME = "tiny-v4"
# A typed turn marker stays plain text in the recipe's encoding (one <｜User｜> id), unlike encode(render()).
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "a<｜User｜>b 你好 🙂"}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dummy-v4-serve")
    (folder / "config.json").write_text(json.dumps(DUMMY_V4))
    return folder


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[ServerThread, list[list[int]]]]:
    """The server, and the prompt ids its engine received (in arrival order)."""
    prompts: list[list[int]] = []

    def factory() -> AsyncLLM:
        llm = AsyncLLM(model_dir, **ENGINE)
        make_request = llm.make_request

        def recording(prompt: Any, params: Any = None) -> Any:
            prompts.append(list(prompt) if isinstance(prompt, list) else prompt)
            return make_request(prompt, params)

        llm.make_request = recording  # type: ignore[method-assign]
        return llm

    srv = ServerThread(create_app(factory, served_model_name=NAME))
    srv.wait_healthy()
    yield srv, prompts
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, **ENGINE) as llm:
        yield llm


@pytest.fixture
def client(served: tuple[ServerThread, list[list[int]]]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].base + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_prompt_tokens_and_greedy_reply_equal_llm_chat(served, client, offline) -> None:
    _, prompts = served
    for messages in CONVERSATIONS:
        want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
        got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0.0)
        assert prompts[-1] == want.prompt_token_ids  # the recipe's ids, not encode(render(...))
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
        assert got.choices[0].message.content == want.outputs[0].text
    assert prompts[-1].count(USER) == 1 and THINK not in prompts[-1]


def test_chat_streams_the_same_reply(served, client) -> None:
    messages = CONVERSATIONS[0]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0.0)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_a_message_the_recipe_rejects_is_a_400(served) -> None:
    srv, _ = served
    status, body = srv.post("/v1/chat/completions", {"model": NAME, "messages": [
        {"role": "tool", "content": "a result with no call"}], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "messages"
    status, _ = srv.post("/v1/chat/completions", {"model": NAME, "messages": CONVERSATIONS[0], "max_tokens": 2})
    assert status == 200


def test_chat_template_kwargs_reach_the_encoding_as_in_llm_chat(served, client, offline) -> None:
    _, prompts = served
    messages = CONVERSATIONS[0]
    # Thinking mode samples at temperature 1 and top_p 1 whatever the request says (the recipe's rule), so the
    # offline call uses those, and both the same seed.
    want = offline.chat(messages, SamplingParams(temperature=1.0, top_p=1.0, seed=5, max_tokens=4), use_tqdm=False,
                        chat_template_kwargs={"thinking": True})[0]
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0.0, seed=5,
                                         extra_body={"chat_template_kwargs": {"thinking": True}})
    assert prompts[-1] == want.prompt_token_ids and prompts[-1][-1] == THINK
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].message.model_extra["reasoning_content"] == want.outputs[0].reasoning
    client.chat.completions.create(model=NAME, messages=messages, max_tokens=1,
                                   extra_body={"chat_template_kwargs": {"thinking": False}})
    assert prompts[-1] == offline.tokenizer.encode_chat(messages)[1] != want.prompt_token_ids


@pytest.mark.parametrize("kwargs", [{"bogus": 1}, {"thinking": "yes"}, ["thinking"]])
def test_a_bad_chat_template_kwarg_is_a_400_naming_the_field(served, kwargs) -> None:
    srv, _ = served
    status, body = srv.post("/v1/chat/completions", {"model": NAME, "messages": CONVERSATIONS[0], "max_tokens": 2,
                                                     "chat_template_kwargs": kwargs})
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs"
    if isinstance(kwargs, dict):
        assert next(iter(kwargs)) in body["error"]["message"]
