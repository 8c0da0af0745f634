"""``deepinfer serve`` (issue 14): the OpenAI-compatible server, started in-process on a free loopback
port (uvicorn in a thread) with a tiny random Llama that has SmolLM2's tokenizer, talked to with the
official ``openai`` client: completions, chat, streaming, seeds, stop strings, logprobs, greedy
outputs equal to ``LLM.generate``; 64 concurrent streaming clients with random disconnects (no KV
leaks, ``/metrics`` counts match); every bad input a 400 (then a good request succeeds); API key."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import uvicorn

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.async_llm import AsyncLLM
from deepinfer.server.app import create_app

pytestmark = pytest.mark.usefixtures("clean_deepinfer_env")

ENGINE = {"kv_cache_bytes": 4 << 20, "block_size": 16}  # 512 blocks of 16 tokens; max_model_len 512
NAME = "tiny-llama"
MAX_BODY = 32 << 10
PROMPTS = ["Hello there", "The capital of France is", "Once upon a time", "1 2 3 4 5"]


class ServerThread:
    """uvicorn on 127.0.0.1 and a free port, in a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"

    def http(self, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
        req = urllib.request.Request(self.base + path, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode()

    def post(self, path: str, payload: Any, **kw: Any) -> tuple[int, Any]:
        return self.http("POST", path, json.dumps(payload).encode(), **kw)

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.http("GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_llama_tok_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(create_app(lambda: AsyncLLM(tiny_llama_tok_dir, **ENGINE), served_model_name=NAME,
                                  max_queue_len=256, max_body_bytes=MAX_BODY))
    srv.wait_healthy()
    yield srv
    srv.stop()
    assert not srv.app.state.deepinfer.llm.is_running  # the app built the engine, so it shut it down


@pytest.fixture(scope="module")
def offline(tiny_llama_tok_dir: Path) -> Iterator[LLM]:
    with LLM(tiny_llama_tok_dir, **ENGINE) as llm:
        yield llm


@pytest.fixture
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_stats(server: ServerThread) -> dict[str, Any]:
    return server.app.state.deepinfer.llm.get_stats()


def wait_idle(server: ServerThread, timeout: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(server)
        if stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
            return stats
        assert time.monotonic() < deadline, f"the engine did not drain: {stats}"
        time.sleep(0.02)


def scrape(server: ServerThread) -> dict[str, float]:
    status, text = server.http("GET", "/metrics")
    assert status == 200
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


# ------------------------------------------------------------------------------------------ basics


def test_health_is_503_until_the_model_is_loaded(tiny_llama_tok_dir: Path) -> None:
    gate = threading.Event()

    def slow_factory() -> AsyncLLM:
        assert gate.wait(30)
        return AsyncLLM(tiny_llama_tok_dir, **ENGINE)

    def failing_factory() -> AsyncLLM:
        raise ValueError("no such model")

    srv = ServerThread(create_app(slow_factory, served_model_name=NAME))
    failed = ServerThread(create_app(failing_factory, served_model_name=NAME))
    try:
        assert srv.http("GET", "/health") == (503, {"status": "loading"})
        status, body = srv.post("/v1/completions", {"model": NAME, "prompt": "hi"})
        assert status == 503 and body["error"]["code"] == "model_not_ready"
        gate.set()
        srv.wait_healthy()
        assert srv.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2})[0] == 200
        deadline = time.monotonic() + 10
        while (status_body := failed.http("GET", "/health"))[1].get("status") == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status, body = status_body
        assert status == 503 and body["status"] == "failed" and "no such model" not in body["error"]  # logged only
    finally:
        srv.stop()
        failed.stop()


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert models.data[0].model_extra["max_model_len"] == 512  # the engine's (ENGINE's note)


def test_completions_greedy_equal_llm_generate(client: openai.OpenAI, offline: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    for prompt, exp in zip(PROMPTS, expected, strict=True):
        resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
        choice = resp.choices[0]
        assert choice.text == exp.outputs[0].text
        assert choice.finish_reason == exp.outputs[0].finish_reason
        assert resp.usage.completion_tokens == len(exp.outputs[0].token_ids)
        assert resp.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert resp.model == NAME and resp.object == "text_completion"
    # token-id prompts too
    ids = offline.tokenizer.encode(PROMPTS[1])
    resp = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert resp.choices[0].text == expected[1].outputs[0].text


def test_penalties_and_logit_bias_equal_llm_generate(client: openai.OpenAI, offline: LLM) -> None:
    """The OpenAI names (and vLLM's repetition_penalty / allowed_token_ids) reach SamplingParams."""
    params = SamplingParams(temperature=0, max_tokens=12, frequency_penalty=1.2, presence_penalty=0.4,
                            repetition_penalty=1.3, logit_bias={5: 4.0, 7: -100.0}, seed=2**64 - 5)
    expected = offline.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].text
    resp = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                     frequency_penalty=1.2, presence_penalty=0.4, logit_bias={"5": 4, "7": -100},
                                     seed=2**64 - 5, extra_body={"repetition_penalty": 1.3})
    assert resp.choices[0].text == expected
    plain = offline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert plain[0].outputs[0].text != expected  # the penalties changed something


def test_chat_greedy_equals_llm_chat(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    exp = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == exp.outputs[0].text
    assert resp.choices[0].finish_reason == exp.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(exp.prompt_token_ids)
    # content as a list of text parts renders the same
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    resp2 = client.chat.completions.create(model=NAME, messages=parts, max_completion_tokens=10, temperature=0)
    assert resp2.choices[0].message.content == exp.outputs[0].text


def test_chat_response_format_json_schema_equals_llm_chat_with_the_schema(client: openai.OpenAI,
                                                                         offline: LLM) -> None:
    """``response_format`` (json_schema, json_object) constrains a chat reply exactly as
    ``SamplingParams.structured`` does offline; the schema-constrained reply parses and fits the schema
    (the random model's free JSON object runs to ``max_tokens``)."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Is Paris in France? Answer in JSON."}]
    for fmt, structured in (({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
                             {"json_schema": schema}),
                            ({"type": "json_object"}, {"json_schema": {"type": "object"}})):
        exp = offline.chat(messages, SamplingParams(temperature=0, max_tokens=40, structured=structured),
                           use_tqdm=False)[0].outputs[0]
        resp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0,
                                              response_format=fmt)
        assert resp.choices[0].message.content == exp.text
        assert resp.choices[0].finish_reason == exp.finish_reason
        if fmt["type"] == "json_schema":  # the enum keeps it short: a complete reply that fits the schema
            assert exp.finish_reason == "stop" and json.loads(exp.text)["answer"] in ("yes", "no")


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": NAME, "max_tokens": 12, "temperature": 0.8, "seed": 5}
    full = client.completions.create(prompt="The ocean is", **kw)
    chunks = list(client.completions.create(prompt="The ocean is", stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    messages = [{"role": "user", "content": "Tell me a story."}]
    full_chat = client.chat.completions.create(messages=messages, **kw)
    stream = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == full_chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == full_chat.choices[0].finish_reason


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                         top_p=0.95, seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b
    assert a != c


def test_stop_strings_cut_the_text_streamed_or_not(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model=NAME, prompt="Hello there", max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    assert len(greedy) >= 6
    stop = greedy[3:6]
    expected = greedy[: greedy.find(stop)]
    resp = client.completions.create(model=NAME, prompt="Hello there", max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAME, prompt="Hello there", max_tokens=16, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected  # a partial stop string is held back
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs(client: openai.OpenAI, offline: LLM) -> None:
    exp = offline.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                                        ignore_eos=True), use_tqdm=False)[0]
    resp = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=6, temperature=0,
                                     logprobs=3, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for got, tid, row in zip(lp.token_logprobs, exp.outputs[0].token_ids, exp.outputs[0].logprobs, strict=True):
        assert got == pytest.approx(row[tid], abs=1e-4)
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0

    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the top one
    streamed = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=5, temperature=0, logprobs=True, stream=True,
                                                   extra_body={"ignore_eos": True}))
    tokens = [c.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs
              for c in ch.choices[0].logprobs.content]
    assert tokens == pytest.approx([c.logprob for c in content], abs=1e-5)


# ------------------------------------------------------------------------------------- bad input


BAD_COMPLETIONS: list[tuple[str, Any, str | None]] = [
    ("unknown field", {"model": NAME, "prompt": "hi", "bogus": 1}, "bogus"),
    ("wrong type", {"model": NAME, "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("no prompt", {"model": NAME}, "prompt"),
    ("negative temperature", {"model": NAME, "prompt": "hi", "temperature": -1}, "temperature"),
    ("temperature above 2", {"model": NAME, "prompt": "hi", "temperature": 2.5}, "temperature"),
    ("top_p 0", {"model": NAME, "prompt": "hi", "top_p": 0}, "top_p"),
    ("max_tokens 0", {"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("n 0", {"model": NAME, "prompt": "hi", "n": 0}, "n"),
    ("n 17", {"model": NAME, "prompt": "hi", "n": 17}, "n"),
    ("logprobs 50", {"model": NAME, "prompt": "hi", "logprobs": 50}, "logprobs"),
    ("seed over uint64", {"model": NAME, "prompt": "hi", "seed": 2**70}, "seed"),
    ("empty stop", {"model": NAME, "prompt": "hi", "stop": [""]}, "stop"),
    ("penalty out of range", {"model": NAME, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("repetition_penalty 0", {"model": NAME, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("logit_bias key not an id", {"model": NAME, "prompt": "hi", "logit_bias": {"a": 1}}, "logit_bias"),
    ("logit_bias over 100", {"model": NAME, "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("two prompts", {"model": NAME, "prompt": ["a", "b"]}, "prompt"),
    ("empty prompt", {"model": NAME, "prompt": ""}, "prompt"),
    ("empty id list", {"model": NAME, "prompt": []}, "prompt"),
    ("token outside vocab", {"model": NAME, "prompt": [1, 10**9]}, "prompt"),
    ("over-long ids", {"model": NAME, "prompt": [5] * 600}, "prompt"),
    ("over-long text", {"model": NAME, "prompt": "hello " * 700}, "prompt"),
    ("bad model AND bad value: 400 first", {"model": "nope", "prompt": "hi", "temperature": -1}, "temperature"),
    ("stream_options without stream", {"model": NAME, "prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options"),
]
BAD_CHAT: list[tuple[str, Any, str | None]] = [
    ("no messages", {"model": NAME, "messages": []}, "messages"),
    ("bad role", {"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("unknown message field", {"model": NAME, "messages": [{"role": "user", "content": "hi", "x": 1}]}, "messages"),
    ("top_logprobs without logprobs", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                       "top_logprobs": 2}, "top_logprobs"),
    ("json_schema without a schema", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                     "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("logprobs as int", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, "logprobs"),
    ("a renderer's own template variable", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                            "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs"),
    ("over-long chat", {"model": NAME, "messages": [{"role": "user", "content": "word " * 700}]}, "messages"),
]


def assert_error(status: int, body: Any, want_status: int, param: str | None = None) -> None:
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


def good_request_succeeds(server: ServerThread) -> None:
    status, body = server.post("/v1/completions", {"model": NAME, "prompt": "ok", "max_tokens": 1})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body


def test_each_bad_input_is_a_400_and_the_server_keeps_serving(server: ServerThread) -> None:
    for path, cases in (("/v1/completions", BAD_COMPLETIONS), ("/v1/chat/completions", BAD_CHAT)):
        for label, payload, param in cases:
            status, body = server.post(path, payload)
            assert status == 400, (label, body)
            assert_error(status, body, 400, param)
            good_request_succeeds(server)
    for raw in (b'{"model": "tiny-llama", "prompt": ', b"[1, 2]", b"\xff\xfe", b""):
        status, body = server.http("POST", "/v1/completions", raw)
        assert_error(status, body, 400)
        good_request_succeeds(server)
    wait_idle(server)


def test_unknown_model_size_and_queue_limits(server: ServerThread, client: openai.OpenAI) -> None:
    status, body = server.post("/v1/completions", {"model": "nope", "prompt": "hi"})
    assert_error(status, body, 404, "model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    big = json.dumps({"model": NAME, "prompt": "x" * (MAX_BODY + 100)}).encode()
    status, body = server.http("POST", "/v1/completions", big)
    assert_error(status, body, 413)
    state = server.app.state.deepinfer
    state.max_queue_len, saved = 0, state.max_queue_len
    try:
        status, body = server.post("/v1/completions", {"model": NAME, "prompt": "hi"})
        assert_error(status, body, 503)
        assert body["error"]["code"] == "queue_full"
    finally:
        state.max_queue_len = saved
    status, body = server.http("GET", "/v1/nothing-here")
    assert_error(status, body, 404)
    good_request_succeeds(server)


def test_api_key(server: ServerThread) -> None:
    state = server.app.state.deepinfer
    state.api_key = "s3cret"
    try:
        for key in ("wrong", "s3cre", ""):
            bad = openai.OpenAI(base_url=server.base + "/v1", api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=NAME, prompt="hi", max_tokens=1)
        status, body = server.post("/v1/completions", {"model": NAME, "prompt": "hi"})  # no header at all
        assert_error(status, body, 401)
        assert server.http("GET", "/v1/models")[0] == 401
        good = openai.OpenAI(base_url=server.base + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=NAME, prompt="hi", max_tokens=1).choices[0].text is not None
        assert server.http("GET", "/health")[0] == 200  # health and metrics stay open
    finally:
        state.api_key = None


# ----------------------------------------------------------------------------------- concurrency


def test_64_concurrent_streams_with_random_disconnects(server: ServerThread, offline: LLM) -> None:
    wait_idle(server)
    before, stats_before = scrape(server), engine_stats(server)
    rng = random.Random(14)
    n = 64
    # client -> chunks it reads; two at least, so every request holds two tokens when it ends (a TPOT sample)
    leave_after = {i: 2 + rng.randrange(3) for i in rng.sample(range(n), 20)}
    disconnect = set(leave_after)
    prompts = [f"Request {i}: tell me about {rng.choice(['tea', 'the sea', 'Paris', 'numbers'])}" for i in range(n)]
    expected = offline.generate([p for i, p in enumerate(prompts) if i not in disconnect],
                                SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    aclient = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(i: int) -> tuple[str, str | None] | None:
        leave = i in disconnect
        stream = await aclient.completions.create(
            model=NAME, prompt=prompts[i], temperature=0, stream=True, max_tokens=300 if leave else 8,
            extra_body={"ignore_eos": True} if leave else None)
        text, finish, n_chunks = "", None, 0
        async for chunk in stream:
            n_chunks += 1
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            if leave and n_chunks == leave_after[i]:
                await stream.close()  # the client goes away mid-stream
                return None
        return text, finish

    async def run_all() -> list[Any]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), timeout=90)
        finally:
            await aclient.close()

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - t0
    survivors = [r for i, r in enumerate(results) if i not in disconnect]
    assert all(r is None for i, r in enumerate(results) if i in disconnect)
    for got, exp in zip(survivors, expected, strict=True):
        assert got is not None and got[1] == exp.outputs[0].finish_reason, got
        assert got[0] == exp.outputs[0].text
    stats = wait_idle(server)  # no KV block leaks: every block is free again
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]

    after = scrape(server)

    def diff(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    finished = sum(diff(k) for k in after if k.startswith("deepinfer_requests_total{"))
    assert finished == n
    assert diff('deepinfer_requests_total{finish_reason="abort"}') == len(disconnect)
    assert diff('deepinfer_http_responses_total{endpoint="/v1/completions",status="200"}') == n
    assert diff("deepinfer_time_to_first_token_seconds_count") == n
    assert diff('deepinfer_time_to_first_token_seconds_bucket{le="+Inf"}') == n
    assert diff("deepinfer_time_per_output_token_seconds_count") == n  # everyone got at least 2 tokens
    assert diff("deepinfer_generation_tokens_total") == stats["generated_tokens"] - stats_before["generated_tokens"]
    assert diff("deepinfer_prompt_tokens_total") == stats["prompt_tokens"] - stats_before["prompt_tokens"]
    assert after["deepinfer_kv_blocks_free"] == after["deepinfer_kv_blocks_total"] == stats["kv_blocks_total"]
    assert after["deepinfer_kv_cache_usage_ratio"] == 0
    assert after["deepinfer_num_requests_running"] == after["deepinfer_server_inflight_requests"] == 0
    assert 0 <= after["deepinfer_prefix_cache_hit_rate"] <= 1
    print(f"64 streams ({len(disconnect)} disconnecting) in {elapsed:.1f} s")


def test_non_streaming_client_that_disconnects_is_aborted(server: ServerThread) -> None:
    wait_idle(server)
    before = scrape(server)
    body = json.dumps({"model": NAME, "prompt": "a long answer please", "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while engine_stats(server)["num_running"] == 0:  # wait until it is being generated
            assert time.monotonic() < deadline
            time.sleep(0.01)
    stats = wait_idle(server)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    after = scrape(server)
    key = 'deepinfer_requests_total{finish_reason="abort"}'
    assert after[key] - before.get(key, 0.0) == 1
    assert after["deepinfer_server_inflight_requests"] == 0


def test_metrics_exposition_is_well_formed(server: ServerThread) -> None:
    """prometheus_client's own parser reads the page: every family typed, the request histograms with
    their buckets, the engine gauges, the process collector."""
    from prometheus_client.parser import text_string_to_metric_families

    assert server.post("/v1/completions", {"model": NAME, "prompt": "hello", "max_tokens": 3})[0] == 200
    status, text = server.http("GET", "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["deepinfer_time_to_first_token_seconds"].type == "histogram"
    assert families["deepinfer_time_per_output_token_seconds"].type == "histogram"
    assert families["deepinfer_requests"].type == "counter"
    assert families["deepinfer_kv_cache_usage_ratio"].type == "gauge"
    assert families["deepinfer_prefix_cache_hit_rate"].type == "gauge"
    assert families["deepinfer_engine_steps"].type == "counter" and "process_cpu_seconds" in families
    buckets = [s for s in families["deepinfer_time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value >= 1
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)


# ------------------------------------------------------------------------------------------ CLI


def test_cli_serve_builds_the_app_and_binds_loopback(tiny_llama_tok_dir: Path, monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    from deepinfer.entrypoints import cli

    seen: dict[str, Any] = {}

    def fake_run(app: Any, **kw: Any) -> None:
        seen.update(kw, state=app.state.deepinfer)

    monkeypatch.setattr(uvicorn, "run", fake_run)
    monkeypatch.setenv("DEEPINFER_API_KEY", "from-env")
    code = cli.main(["serve", "--model", str(tiny_llama_tok_dir), "--port", "8123",
                     "--set", "cache.kv_cache_bytes=4194304", "--set", "cache.block_size=16"])
    assert code == 0
    state = seen["state"]
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8123
    assert state.served_model_name == str(tiny_llama_tok_dir) and state.api_key == "from-env"
    assert state.llm is not None
    state.llm.shutdown()



def test_bench_against_the_server(server: ServerThread, tiny_llama_tok_dir: Path, tmp_path: Path) -> None:
    """``deepinfer bench --url``: the workload over HTTP at two request rates, every token counted."""
    from deepinfer.entrypoints import cli

    out = tmp_path / "http.json"
    code = cli.main(["bench", "--url", server.base, "--model", str(tiny_llama_tok_dir), "--served-model-name", NAME,
                     "--num-prompts", "6", "--input-len", "12", "--output-len", "5", "--request-rate", "50,inf",
                     "--output", str(out), "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["request_rate"] for r in report["runs"]] == [50.0, "inf"]
    for run in report["runs"]:
        assert run["engine"] == "http" and run["failed_requests"] == 0
        assert run["num_requests"] == 6 and run["total_output_tokens"] == 30
        assert run["ttft_ms"]["median"] > 0 and run["tpot_ms"]["median"] > 0
    wait_idle(server)
