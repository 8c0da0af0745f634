"""Issue 35: ``n`` > 1 choices (each equal to a single request with its derived seed, whole and streamed
with ``index`` per choice, logprobs per choice, the prompt's blocks shared through the prefix cache) on a
tiny random Llama with SmolLM2's tokenizer; ``tool_choice`` on the real SmolLM2, a model without a
tool-call format (a named function constrained by xgrammar to its parameter schema and returned as a
tool call; ``auto`` refused). The official ``openai`` client against an in-process server (CPU)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from test_server import ServerThread, engine_stats, wait_idle

from deepinfer.entrypoints.async_llm import AsyncLLM
from deepinfer.server.app import create_app
from deepinfer.server.choices import choice_seed

pytestmark = pytest.mark.usefixtures("clean_deepinfer_env", "one_torch_thread")

NAME = "tiny-llama"
# Two full 16-token blocks and a partial one: choices 1..n-1 find the two full blocks in the prefix cache.
PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type and oil-based "
          "inks changed how books were made across Europe, and within a few decades printers in many cities "
          "were")
SEED = 1234


@pytest.fixture(scope="module")
def server(tiny_llama_tok_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(create_app(lambda: AsyncLLM(tiny_llama_tok_dir, kv_cache_bytes=4 << 20, block_size=16),
                                  served_model_name=NAME))
    srv.wait_healthy()
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_choice_seeds_are_the_request_seed_then_distinct() -> None:
    seeds = [choice_seed(SEED, i) for i in range(16)]
    assert seeds[0] == SEED and len(set(seeds)) == 16 and all(0 <= s < 2**64 for s in seeds)
    assert choice_seed(None, 3) is None
    assert choice_seed(SEED, 1) != SEED + 1


def test_n_choices_equal_single_requests_with_the_derived_seeds(server, client) -> None:
    wait_idle(server)
    before = engine_stats(server)["prefix_cache_hit_tokens"]
    got = client.completions.create(model=NAME, prompt=PROMPT, n=3, seed=SEED, max_tokens=8, temperature=1.0,
                                    logprobs=2)
    hits = engine_stats(server)["prefix_cache_hit_tokens"] - before
    prompt_tokens = got.usage.prompt_tokens
    full_blocks = (prompt_tokens - 1) // 16  # the last prompt token is always computed (its logits are needed)
    assert full_blocks == 2 and hits >= 2 * full_blocks * 16  # choices 1 and 2 took them from choice 0
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert got.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in got.choices)
    for i, choice in enumerate(got.choices):
        single = client.completions.create(model=NAME, prompt=PROMPT, seed=choice_seed(SEED, i), max_tokens=8,
                                           temperature=1.0, logprobs=2).choices[0]
        assert (choice.text, choice.logprobs.tokens) == (single.text, single.logprobs.tokens)
        assert choice.logprobs.token_logprobs == pytest.approx(single.logprobs.token_logprobs, abs=1e-4)
    assert len({c.text for c in got.choices}) > 1  # distinct seeds, distinct samples
    wait_idle(server)  # every choice's blocks came back


def test_n_chat_choices_stream_with_an_index_each(client) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=NAME, messages=messages, n=3, seed=SEED, max_tokens=6,
                                           logprobs=True, top_logprobs=1)
    stream = client.chat.completions.create(model=NAME, messages=messages, n=3, seed=SEED, max_tokens=6,
                                            logprobs=True, top_logprobs=1, stream=True,
                                            stream_options={"include_usage": True})
    text, tokens, finish = ["", "", ""], [0, 0, 0], [None, None, None]
    chunks = list(stream)
    for chunk in chunks:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            tokens[c.index] += len(c.logprobs.content) if c.logprobs else 0
            finish[c.index] = c.finish_reason or finish[c.index]
    assert text == [c.message.content for c in whole.choices]
    assert tokens == [len(c.logprobs.content) for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == sum(tokens)


def test_a_dropped_n_stream_frees_every_choice(server) -> None:
    import urllib.request

    body = json.dumps({"model": NAME, "prompt": PROMPT, "n": 4, "max_tokens": 200, "stream": True,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(server.base + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        seen = set()
        while len(seen) < 4:  # every choice is running
            line = resp.readline().decode()
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
    wait_idle(server)  # the disconnect aborted all four


def test_tool_choice_auto_needs_a_tool_call_format(server) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for fields, param in (({"tools": [tool]}, "tool_choice"), ({"tools": [tool, {**tool, "function": {"name": "g"}}],
                                                                 "tool_choice": "required"}, "tool_choice"),
                          ({"reasoning_effort": "high"}, "reasoning_effort")):
        status, body = server.post("/v1/chat/completions", {"model": NAME, "max_tokens": 2, **fields,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and body["error"]["param"] == param, body
    status, body = server.post("/v1/chat/completions", {"model": NAME, "max_tokens": 2, "tools": [tool],
                                                        "tool_choice": "none",
                                                        "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and "tool_calls" not in body["choices"][0]["message"]


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": SCHEMA}}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def smol_client(smollm2_dir: Path) -> Iterator[openai.OpenAI]:
    srv = ServerThread(create_app(lambda: AsyncLLM(smollm2_dir, kv_cache_bytes=1 << 26, max_model_len=1024),
                                  served_model_name="smol"))
    srv.wait_healthy()
    yield openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    srv.stop()


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_smollm2_forced_call_has_arguments_valid_under_the_schema(smol_client, tool_choice) -> None:
    got = smol_client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                                              temperature=0.0, max_tokens=48)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)

    if tool_choice == "required":
        return  # the same constraint as the named function's (one tool); its stream is checked once, below
    stream = smol_client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                                                 temperature=0.0, max_tokens=48, stream=True)
    deltas = [d for chunk in stream for c in chunk.choices for d in c.delta.tool_calls or ()]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_smollm2_tool_result_goes_back_into_the_next_turn(smol_client, smollm2_dir) -> None:
    from deepinfer.tokenizer import Tokenizer

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    got = smol_client.chat.completions.create(model="smol", messages=messages, max_tokens=4, temperature=0.0)
    text, ids = Tokenizer(smollm2_dir).encode_chat([*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                                                    {"role": "tool", "content": "21 degrees and sunny",
                                                     "tool_call_id": "call_1"}])
    assert "21 degrees and sunny" in text and got.usage.prompt_tokens == len(ids)
