"""Hostile-but-fair HTTP clients (issue 24): client errors stay 4xx with an OpenAI-style body naming the
parameter, a 500 never carries an internal repr (it is logged under a request id), ``/health`` does not
expose the load error."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_server import ENGINE, NAME, ServerThread, assert_error, good_request_succeeds

from deepinfer.entrypoints.async_llm import AsyncLLM
from deepinfer.server.app import create_app

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
