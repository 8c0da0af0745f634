"""Issue 35: a DeepSeek-V4 model served like DeepSeek's own API. Replies go through deepseek-recipe's stream
processor: ``reasoning_content`` apart from ``content`` (whole and streamed, equal to ``LLM.chat``'s split),
tool calls parsed into ``message.tool_calls`` (whole and streamed), a tool-call round trip, the
``tool_call_required`` constraint as a DSML grammar, the recipe's thinking-mode sampling rule, bad tool
specs as 400s naming the field. The tiny dummy V4 model writes random tokens, so its replies are forced
with ``golden_token_ids`` (set by the test on the server's requests), as the issue says (CPU, seconds)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
from test_deepseek_text import DUMMY_V4, END_THINK, EOS, THINK
from test_server import ServerThread

from deepinfer import LLM, SamplingParams
from deepinfer.chat_output import DSML, tool_call_grammar
from deepinfer.entrypoints.async_llm import AsyncLLM
from deepinfer.server.app import create_app
from deepinfer.tokenizer_deepseek import DeepseekV4Tokenizer

pytestmark = pytest.mark.usefixtures("clean_deepinfer_env", "one_torch_thread")

ENGINE = {"tokenizer": "deepseek-v4", "load_format": "dummy", "seed": 7, "max_num_seqs": 4,
          "cache": {"kv_cache_bytes": 1 << 22, "block_size": 16}}
NAME = "tiny-v4"
QUESTION = [{"role": "user", "content": "What is 2+2?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
INVOKE = (f'<{DSML}invoke name="get_weather">\n'
          f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
          f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n'
          f'</{DSML}invoke>\n</{DSML}tool_calls>')


class Recorder:
    """What the server's engine received (prompt ids and params), and the golden ids it forces next."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self.golden: list[int] | None = None


@pytest.fixture(scope="module")
def tok() -> DeepseekV4Tokenizer:
    return DeepseekV4Tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dummy-v4-replies")
    (folder / "config.json").write_text(json.dumps(DUMMY_V4))
    return folder


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[ServerThread, Recorder]]:
    rec = Recorder()

    def factory() -> AsyncLLM:
        llm = AsyncLLM(model_dir, **ENGINE)
        make_request = llm.make_request

        def recording(prompt: Any, params: SamplingParams | None = None) -> Any:
            assert params is not None
            if rec.golden is not None:
                params = replace(params, seq_seed=None, golden_token_ids=rec.golden)
            rec.prompts.append(list(prompt))
            rec.params.append(params)
            return make_request(prompt, params)

        llm.make_request = recording  # type: ignore[method-assign]
        return llm

    srv = ServerThread(create_app(factory, served_model_name=NAME))
    srv.wait_healthy()
    yield srv, rec
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, **ENGINE) as llm:
        yield llm


@pytest.fixture
def client(served: tuple[ServerThread, Recorder]) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(base_url=served[0].base + "/v1", api_key="unused", max_retries=0, timeout=60)
    served[1].golden = None


def forced(tok: DeepseekV4Tokenizer, text: str) -> list[int]:
    return [*tok.encode(text), EOS]


def stream_parts(stream: Any) -> tuple[str, str, list[Any], list[str | None]]:
    """(reasoning, content, tool-call deltas, finish reasons) of a chat stream."""
    reasoning, content, calls, finishes = "", "", [], []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
            finishes.append(choice.finish_reason)
    return reasoning, content, calls, finishes


def test_thinking_reply_is_split_as_llm_chat_splits_it(served, client, offline, tok) -> None:
    _, rec = served
    golden = forced(tok, "Two plus two: add them.</think>It is 4.")
    want = offline.chat(QUESTION, SamplingParams(max_tokens=64, golden_token_ids=golden), use_tqdm=False,
                        chat_template_kwargs={"thinking": True})[0].outputs[0]
    assert (want.reasoning, want.text, want.tool_calls) == ("Two plus two: add them.", "It is 4.", None)
    rec.golden = golden
    got = client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=64,
                                         extra_body={"chat_template_kwargs": {"thinking": True}})
    message = got.choices[0].message
    assert rec.prompts[-1][-1] == THINK
    assert (message.model_extra["reasoning_content"], message.content) == (want.reasoning, want.text)
    assert got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == len(golden)  # EOS counted as generated, never parsed
    reasoning, content, _, finishes = stream_parts(client.chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=64, stream=True,
        extra_body={"chat_template_kwargs": {"thinking": True}}))
    assert (reasoning, content) == (want.reasoning, want.text)
    assert [f for f in finishes if f] == ["stop"]


def test_a_stop_string_is_cut_from_the_parsed_content(served, client, offline, tok) -> None:
    _, rec = served
    golden = forced(tok, "It is 4. Done, and more.")
    want = offline.chat(QUESTION, SamplingParams(max_tokens=64, golden_token_ids=golden, stop=["Done"]),
                        use_tqdm=False)[0].outputs[0]
    assert want.text == "It is 4. " and want.finish_reason == "stop"
    rec.golden = golden
    got = client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=64, stop=["Done"])
    assert got.choices[0].message.content == want.text
    _, content, _, _ = stream_parts(client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=64,
                                                                   stop=["Done"], stream=True))
    assert content == want.text


def test_n_parsed_choices_stream_with_an_index_and_logprobs_each(served, client, tok) -> None:
    _, rec = served
    rec.golden = golden = forced(tok, "Add.</think>4.")
    kwargs = {"model": NAME, "messages": QUESTION, "n": 2, "max_tokens": 32, "logprobs": True, "top_logprobs": 1,
              "extra_body": {"chat_template_kwargs": {"thinking": True}}}
    whole = client.chat.completions.create(**kwargs)
    assert [(c.index, c.message.model_extra["reasoning_content"], c.message.content) for c in whole.choices] == [
        (0, "Add.", "4."), (1, "Add.", "4.")]
    assert [len(c.logprobs.content) for c in whole.choices] == [len(golden)] * 2
    parts: dict[int, list[str]] = {0: ["", ""], 1: ["", ""]}
    logprobs = [0, 0]
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            parts[c.index][0] += (c.delta.model_extra or {}).get("reasoning_content") or ""
            parts[c.index][1] += c.delta.content or ""
            logprobs[c.index] += len(c.logprobs.content) if c.logprobs else 0
    assert parts == {0: ["Add.", "4."], 1: ["Add.", "4."]} and logprobs == [len(golden)] * 2


def test_response_format_goes_through_the_recipe_and_starts_after_the_thinking(served, client, tok) -> None:
    srv, rec = served
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    body = {"model": NAME, "messages": QUESTION, "max_tokens": 48,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    rec.golden = forced(tok, '{"answer": 4}')
    status, got = srv.post("/v1/chat/completions", body)
    assert status == 200 and json.loads(got["choices"][0]["message"]["content"]) == {"answer": 4}
    assert "adhere to the following schema" in tok.decode(rec.prompts[-1])  # the recipe's prompt asks for it
    assert json.loads(rec.params[-1].structured["json_schema"]) == schema

    thinking = {**body, "chat_template_kwargs": {"thinking": True}}
    rec.golden = forced(tok, 'Two and {two}.</think>{"answer": 4}')  # the reasoning is free, not JSON
    status, got = srv.post("/v1/chat/completions", thinking)
    message = got["choices"][0]["message"]
    assert status == 200 and message["reasoning_content"] == "Two and {two}."
    assert json.loads(message["content"]) == {"answer": 4}
    assert rec.params[-1].so_args["trigger_token_ids"] == [END_THINK] and rec.params[-1].structured is None
    rec.golden = forced(tok, "Two and two.</think>four")  # not JSON after the thinking: refused
    status, got = srv.post("/v1/chat/completions", thinking)
    rec.golden = None
    assert status == 500 and "refused the sampled token" in got["error"]["message"]


def test_reasoning_effort_turns_thinking_on_with_the_recipes_sampling_rule(served, client) -> None:
    _, rec = served
    client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=2, temperature=0.0, top_p=0.5,
                                   reasoning_effort="high")
    assert rec.prompts[-1][-1] == THINK  # thinking mode
    assert (rec.params[-1].temperature, rec.params[-1].top_p) == (1.0, 1.0)  # the recipe fixes both
    client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=2, temperature=0.0, top_p=0.5)
    assert rec.prompts[-1][-1] != THINK
    assert (rec.params[-1].temperature, rec.params[-1].top_p) == (0.0, 0.5)  # outside it: as requested


def test_tool_call_round_trip(served, client, tok) -> None:
    _, rec = served
    rec.golden = forced(tok, "Let me look.\n\n<" + DSML + "tool_calls>\n" + INVOKE)
    first = client.chat.completions.create(model=NAME, messages=QUESTION, tools=[WEATHER], max_tokens=128)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    rec.golden = forced(tok, "It is sunny in Paris.")
    messages = [*QUESTION,
                {"role": "assistant", "content": choice.message.content, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=64)
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason == "stop"
    prompt = tok.decode(rec.prompts[-1])
    assert "sunny, 21 C" in prompt and f'<{DSML}invoke name="get_weather">' in prompt  # both turns rendered


def test_tool_call_streams_as_deltas(served, client, tok) -> None:
    _, rec = served
    rec.golden = forced(tok, "<" + DSML + "tool_calls>\n" + INVOKE)
    _, content, calls, finishes = stream_parts(client.chat.completions.create(
        model=NAME, messages=QUESTION, tools=[WEATHER], max_tokens=128, stream=True))
    assert content == "" and [f for f in finishes if f] == ["tool_calls"]
    assert calls[0].id and calls[0].function.name == "get_weather" and {c.index for c in calls} == {0}
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris", "days": 3}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_is_constrained_to_the_recipes_markup(served, client, tok, tool_choice) -> None:
    _, rec = served
    rec.golden = forced(tok, INVOKE)  # the prompt opened the tool-call block
    got = client.chat.completions.create(model=NAME, messages=QUESTION, tools=[WEATHER], tool_choice=tool_choice,
                                         max_tokens=128)
    assert tok.decode(rec.prompts[-1]).endswith(f"<{DSML}tool_calls>\n")
    assert "get_weather" in rec.params[-1].structured["ebnf"]
    (call,) = got.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert got.choices[0].finish_reason == "tool_calls"


def test_an_output_off_the_markup_is_refused_by_the_constraint(served, tok) -> None:
    srv, rec = served
    rec.golden = forced(tok, "Sure, here you go.")  # plain text where the grammar wants an invoke block
    try:
        status, body = srv.post("/v1/chat/completions", {"model": NAME, "messages": QUESTION, "tools": [WEATHER],
                                                         "tool_choice": "required", "max_tokens": 32})
    finally:
        rec.golden = None
    assert status == 500 and "refused the sampled token" in body["error"]["message"], body


def test_the_tool_call_grammar_accepts_calls_of_declared_functions_only(tok) -> None:
    xgr = pytest.importorskip("xgrammar")
    grammar = tool_call_grammar([WEATHER])
    info = xgr.TokenizerInfo(["<eos>"], vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)

    def accepts(text: str) -> bool:  # the whole text, then the end (the stop token)
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.accept_token(0)

    assert accepts(INVOKE)
    assert accepts(INVOKE.replace('string="false">3<', 'string="false">[1, {"a": null}]<'))
    assert not accepts(INVOKE.replace("get_weather", "get_time"))  # an undeclared function
    assert not accepts(INVOKE.replace('"city"', '"town"'))  # an undeclared parameter
    assert not accepts(INVOKE.replace(">3<", ">three<"))  # a non-string parameter must be JSON
    assert not accepts(INVOKE[: -len(f"</{DSML}tool_calls>")])  # the block must end


BAD_TOOLS = [
    ("invalid schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]}, "tools"),
    ("parameters not an object", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ("bad name", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
    ("twice", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("not a function", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ("unknown name", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("required, no tools", {"tool_choice": "required"}, "tool_choice"),
    ("bad choice", {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ("required in thinking mode", {"tools": [WEATHER], "tool_choice": "required",
                                   "chat_template_kwargs": {"thinking": True}}, "tool_choice"),
]


@pytest.mark.parametrize(("label", "fields", "param"), BAD_TOOLS, ids=[b[0] for b in BAD_TOOLS])
def test_a_bad_tool_spec_is_a_400_naming_the_field(served, label, fields, param) -> None:
    srv, _ = served
    status, body = srv.post("/v1/chat/completions", {"model": NAME, "messages": QUESTION, "max_tokens": 2, **fields})
    assert status == 400 and body["error"]["param"] == param, (label, body)
