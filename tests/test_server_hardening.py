"""Hostile-but-fair HTTP clients (issue 24): client errors stay 4xx with an OpenAI-style body naming the
parameter, a 500 never carries an internal repr (it is logged under a request id), ``/health`` does not
expose the load error; the event loop cannot be stalled (incremental stop hold-back, tokenization and
template rendering on worker threads, a body-read timeout, stop-string limits); ``/metrics`` can be
guarded with its own key."""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_server import ENGINE, NAME, ServerThread, assert_error, good_request_succeeds

from deepinfer.entrypoints.async_llm import AsyncLLM
from deepinfer.server.app import create_app
from deepinfer.server.protocol import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from deepinfer.server.stops import StopHoldBack
from deepinfer.tokenizer import GIL_FREE_ENCODE_CHARS, Tokenizer

pytestmark = pytest.mark.usefixtures("clean_deepinfer_env")
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_tok_dir: Path) -> Iterator[ServerThread]:
    srv = ServerThread(create_app(lambda: AsyncLLM(tiny_llama_tok_dir, **ENGINE), served_model_name=NAME))
    srv.wait_healthy()
    yield srv
    srv.stop()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}}}


def test_client_errors_are_400s_naming_the_parameter(server: ServerThread) -> None:
    cases: list[tuple[str, str, bytes, str | None]] = [
        ("JSON nested 100,000 deep", "/v1/completions",
         f'{{"model": "{NAME}", "prompt": "hi", "x": {_nested(100_000)}}}'.encode(), None),
        ("template kwargs nested deep", CHAT,
         json.dumps({"model": NAME, "messages": HELLO}).encode()[:-1]
         + f', "chat_template_kwargs": {{"a": {_nested(5_000)}}}}}'.encode(), None),
        ("chat_template_kwargs.messages", CHAT,
         json.dumps({"model": NAME, "messages": HELLO, "chat_template_kwargs": {"messages": []}}).encode(),
         "chat_template_kwargs"),
        ("lone surrogate in a prompt", "/v1/completions",
         b'{"model": "tiny-llama", "prompt": "abc \\ud800 def", "max_tokens": 1}', "prompt"),
        ("lone surrogate in a message", CHAT,
         b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}',
         "messages"),
        ("infinite temperature", "/v1/completions",
         b'{"model": "tiny-llama", "prompt": "hi", "temperature": Infinity}', "temperature"),
        ("NaN top_p", "/v1/completions", b'{"model": "tiny-llama", "prompt": "hi", "top_p": NaN}', "top_p"),
    ]
    for stream in (False, True):
        cases.append((f"invalid schema (stream={stream})", CHAT,
                      json.dumps({"model": NAME, "messages": HELLO, "response_format": BAD_SCHEMA,
                                  "max_tokens": 4, "stream": stream}).encode(), "response_format"))
    for label, path, raw, param in cases:
        status, body = server.http("POST", path, raw)
        assert status == 400, (label, body)
        assert_error(status, body, 400, param)
        assert "Error(" not in body["error"]["message"], (label, body)  # no repr of an exception
        good_request_succeeds(server)
    stats = server.app.state.deepinfer.llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and server.app.state.deepinfer.inflight == 0


def test_a_500_names_a_request_id_and_logs_the_details(server: ServerThread, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    state = server.app.state.deepinfer

    def broken(*args: Any) -> str:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(state.metrics, "render", broken)
    with caplog.at_level(logging.ERROR, logger="deepinfer.server.app"):
        status, body = server.http("GET", "/metrics")
    assert_error(status, body, 500)
    message = body["error"]["message"]
    assert "secret" not in message and "RuntimeError" not in message
    request_id = message.split("request id ")[1].split(";")[0]
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and "secret internal detail" in str(logged[0].exc_info[1])


def test_health_does_not_expose_the_load_error() -> None:
    def failing_factory() -> AsyncLLM:
        raise ValueError("/home/someone/secret/path is not a model")

    failed = ServerThread(create_app(failing_factory, served_model_name=NAME))
    try:
        while (answer := failed.http("GET", "/health"))[1].get("status") == "loading":
            pass
        status, body = answer
        assert status == 503 and body["status"] == "failed"
        assert "secret" not in json.dumps(body) and "ValueError" not in json.dumps(body)
    finally:
        failed.stop()


# ------------------------------------------------------------------------- the loop nobody can stall


def _naive_hold(text: str, stops: list[str]) -> int:
    """The longest suffix of ``text`` that is a prefix of some stop (the definition, for the automaton)."""
    return max((k for s in stops for k in range(1, min(len(s), len(text)) + 1) if text.endswith(s[:k])), default=0)


def test_stop_holdback_is_incremental_and_exact() -> None:
    rng = random.Random(24)
    for _ in range(200):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 64))]
        holdback = StopHoldBack(stops)
        text = ""
        for _ in range(rng.randint(1, 30)):
            text += "".join(rng.choice("abcd") for _ in range(rng.randint(0, 4)))
            assert holdback.advance(text) == _naive_hold(text, stops), (text, stops)
        assert holdback.chars_fed == len(text)  # every character once, whatever the number of stops
    holdback = StopHoldBack(["xyz"])
    holdback.advance("abcxy")
    assert holdback.advance("abQ") == 0 and holdback.advance("abQxyz") == 3  # a changed prefix is re-fed


def test_stop_string_limits(server: ServerThread) -> None:
    for stop, word in (([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], "strings"),
                       (["x" * (MAX_STOP_LENGTH + 1)], "characters")):
        status, body = server.post("/v1/completions", {"model": NAME, "prompt": "hi", "stop": stop})
        assert_error(status, body, 400, "stop")
        assert word in body["error"]["message"]
    stops = [f"never-{i}-" + "z" * (MAX_STOP_LENGTH - 10) for i in range(MAX_STOP_STRINGS)]
    payload = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stop": stops}
    status, whole = server.post("/v1/completions", payload)
    assert status == 200
    streamed = _stream_text(server, {**payload, "stream": True})
    assert streamed == whole["choices"][0]["text"]


def _stream_text(server: ServerThread, payload: dict[str, Any]) -> str:
    req = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_tokenization_and_rendering_run_off_the_loop(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = server.app.state.deepinfer.llm.tokenizer
    threads: dict[str, list[str]] = {"encode_prompt": [], "encode_chat": []}
    for name, calls in threads.items():
        inner = getattr(tokenizer, name)

        def spy(*args: Any, _inner: Any = inner, _calls: list[str] = calls, **kwargs: Any) -> Any:
            _calls.append(threading.current_thread().name)
            return _inner(*args, **kwargs)

        monkeypatch.setattr(tokenizer, name, spy)
    assert server.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 1})[0] == 200
    assert server.post(CHAT, {"model": NAME, "messages": HELLO, "max_tokens": 1})[0] == 200
    assert threads["encode_prompt"] and threads["encode_chat"]
    loop_thread = server.thread.name
    for calls in threads.values():
        assert all(n.startswith("deepinfer-tokenize") and n != loop_thread for n in calls), threads


def test_long_texts_are_encoded_with_the_gil_released(tiny_llama_tok_dir: Path) -> None:
    tok = Tokenizer(tiny_llama_tok_dir)
    text = "hello world, some text. " * (GIL_FREE_ENCODE_CHARS // 10)
    want = tok.encode(text[:GIL_FREE_ENCODE_CHARS])  # the plain path

    class Spy:
        def __init__(self, inner: Any) -> None:
            self.inner, self.batches = inner, 0

        def encode_batch(self, *args: Any, **kwargs: Any) -> Any:
            self.batches += 1
            return self.inner.encode_batch(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    tok._tok = spy = Spy(tok._tok)  # type: ignore[assignment]
    assert tok.encode(text[:GIL_FREE_ENCODE_CHARS]) == want and spy.batches == 0
    assert tok.encode(text) == spy.inner.encode(text, add_special_tokens=False).ids and spy.batches == 1


def _read_response(sock: socket.socket) -> str:
    """One HTTP response off a raw socket: the head, then ``content-length`` bytes of body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return (head + b"\r\n\r\n" + body).decode()


def test_a_body_that_trickles_is_a_408(tiny_llama_tok_dir: Path) -> None:
    srv = ServerThread(create_app(lambda: AsyncLLM(tiny_llama_tok_dir, **ENGINE), served_model_name=NAME,
                                  body_timeout_s=0.5))
    try:
        srv.wait_healthy()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": ")
            answer = _read_response(sock)  # blocks until the server gives up on the body
        assert answer.startswith("HTTP/1.1 408"), answer
        assert "request_timeout" in answer and "--body-timeout" in answer
        assert srv.http("GET", "/health")[0] == 200
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------- /metrics


def test_metrics_are_open_unless_a_metrics_key_is_set(tiny_llama_tok_dir: Path) -> None:
    llm = AsyncLLM(tiny_llama_tok_dir, **ENGINE)
    try:
        open_srv = ServerThread(create_app(llm, served_model_name=NAME, api_key="v1-key"))
        guarded = ServerThread(create_app(llm, served_model_name=NAME, api_key="v1-key", metrics_api_key="m-key"))
        try:
            assert open_srv.http("GET", "/metrics")[0] == 200  # open by default, as in vLLM, even with --api-key
            assert_error(*guarded.http("GET", "/metrics"), 401)
            assert_error(*guarded.http("GET", "/metrics", headers={"Authorization": "Bearer v1-key"}), 401)
            status, text = guarded.http("GET", "/metrics", headers={"Authorization": "Bearer m-key"})
            assert status == 200 and "deepinfer_" in text
            assert guarded.http("GET", "/health")[0] == 200  # health stays open
        finally:
            open_srv.stop()
            guarded.stop()
    finally:
        llm.shutdown()


def test_cli_serve_passes_the_limits_to_uvicorn(tiny_llama_tok_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from deepinfer.entrypoints import cli

    seen: dict[str, Any] = {}

    def fake_run(app: Any, **kw: Any) -> None:
        seen.update(kw, state=app.state.deepinfer)

    monkeypatch.setattr(uvicorn, "run", fake_run)
    monkeypatch.setenv("DEEPINFER_METRICS_API_KEY", "m-env")
    code = cli.main(["serve", "--model", str(tiny_llama_tok_dir), "--body-timeout", "7", "--max-connections", "99",
                     "--set", "cache.kv_cache_bytes=4194304", "--set", "cache.block_size=16"])
    assert code == 0
    state = seen["state"]
    assert seen["limit_concurrency"] == 99 and state.body_timeout_s == 7 and state.metrics_api_key == "m-env"
    state.llm.shutdown()
