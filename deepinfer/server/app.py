"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) over ``AsyncLLM``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` answers as
server-sent events), ``GET /v1/models``, ``GET /health`` (200 only once the model is loaded),
``GET /metrics`` (Prometheus text). The ``/v1`` endpoints check the API key when one is set.

Order of checks for a generation request: API key (401) → body size (413) → JSON and fields (400)
→ sampling values (400) → model loaded (503) → prompt against the model: tokenization, vocabulary,
``max_model_len`` (400) → model name (404) → queue length (503). A client that disconnects aborts its
request (streaming: the response task is cancelled; non-streaming: the handler polls for the
disconnect), which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2.exceptions import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.entrypoints.async_llm import AsyncLLM
from deepinfer.errors import ChatOptionError
from deepinfer.outputs import RequestOutput
from deepinfer.sampling.params import SamplingParams
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.protocol import APIError, ChatRequest, CompletionRequest, bad_request, parse_body

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_QUEUE_LEN = 1024
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class ServerState:
    """What the handlers share: the engine (once loaded), limits, metrics, the in-flight count."""

    def __init__(self, served_model_name: str, api_key: str | None, max_body_bytes: int,
                 max_queue_len: int) -> None:
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_queue_len = max_queue_len
        self.metrics = ServerMetrics()
        self.llm: AsyncLLM | None = None
        self.load_error: BaseException | None = None
        self.inflight = 0
        self.created = int(time.time())

    def attach(self, llm: AsyncLLM) -> None:
        llm.finish_listeners.append(self.metrics.on_finish)
        self.llm = llm

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, self.api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                           param=None, code="invalid_api_key")

    def ready(self) -> AsyncLLM:
        if self.llm is None or not self.llm.is_running:
            raise APIError(503, "the model is not loaded (yet)", type="service_unavailable",
                           code="model_not_ready")
        return self.llm

    def check_model(self, name: str) -> None:
        if name != self.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", param="model", code="model_not_found")

    def admit(self) -> None:
        if self.inflight >= self.max_queue_len:
            raise APIError(503, f"the server is at its queue limit ({self.max_queue_len} requests); retry later",
                           type="service_unavailable", code="queue_full")
        self.inflight += 1


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body has {length} bytes; the limit is {limit}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class _CountResponses:
    """ASGI middleware: counts responses by endpoint and status for ``/metrics``."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.on_http(endpoint, int(message["status"]))
            await send(message)

        await self.app(scope, receive, counting_send)


class _EventStream(StreamingResponse):
    """Server-sent events whose ``on_close`` runs however the response ends (also when it never
    started), and whose iterator is closed at once on a disconnect (which aborts the request)."""

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Delta:
    """Turns cumulative outputs into stream deltas. While a request runs, text that could still be
    cut (a partial stop string at the end, an incomplete UTF-8 character) is held back."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.sent = ""
        self.tokens = 0

    def step(self, out: RequestOutput) -> tuple[str, int, int]:
        text = out.outputs[0].text
        end = len(text)
        if not out.finished:
            while end > len(self.sent) and text[end - 1] == "\ufffd":
                end -= 1
            end -= self._partial_stop(text[:end])
        delta = ""
        if end > len(self.sent) and text.startswith(self.sent):
            delta = text[len(self.sent):end]
            self.sent = text[:end]
        first, self.tokens = self.tokens, len(out.outputs[0].token_ids)
        return delta, first, self.tokens

    def _partial_stop(self, text: str) -> int:
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return hold


def _finish_reason(out: RequestOutput) -> str | None:
    reason = out.outputs[0].finish_reason
    return None if reason is None else ("stop" if reason == "abort" else reason)


def _usage(out: RequestOutput) -> dict[str, int]:
    p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _check_error(out: RequestOutput) -> None:
    if out.outputs[0].finish_reason == "error":
        raise APIError(500, f"generation failed: {out.outputs[0].error}", type="server_error", code="engine_error")


class _Formatter:
    """Logprobs in the two OpenAI shapes."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.tokenizer = llm.tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def completion_logprobs(self, out: RequestOutput, first: int, last: int, offset: int) -> dict[str, Any]:
        comp = out.outputs[0]
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, row in zip(comp.token_ids[first:last], (comp.logprobs or [])[first:last], strict=False):
            s = self.token(tid)
            tokens.append(s)
            token_lps.append(row.get(tid))
            tops.append({self.token(t): lp for t, lp in sorted(row.items(), key=lambda kv: -kv[1])})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, out: RequestOutput, first: int, last: int, top_n: int) -> dict[str, Any]:
        comp = out.outputs[0]
        content = []
        for tid, row in zip(comp.token_ids[first:last], (comp.logprobs or [])[first:last], strict=False):
            s = self.token(tid)
            best = sorted(row.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({
                "token": s, "logprob": row.get(tid), "bytes": list(s.encode()),
                "top_logprobs": [{"token": self.token(t), "logprob": lp, "bytes": list(self.token(t).encode())}
                                 for t, lp in best],
            })
        return {"content": content}


async def _last_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    last = None
    async for out in gen:
        last = out
    return last


async def _final_output(gen: AsyncIterator[RequestOutput], request: Request,
                        release: Callable[[], None]) -> RequestOutput | None:
    """A non-streaming request's checked final output (None: the client left), releasing its queue slot."""
    try:
        final = await _run_unless_disconnected(gen, request)
    finally:
        release()
    if final is not None:
        _check_error(final)
    return final


async def _run_unless_disconnected(gen: AsyncIterator[RequestOutput], request: Request) -> RequestOutput | None:
    """The final output, or None when the client went away (the request is then aborted)."""
    task = asyncio.ensure_future(_last_output(gen))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
    finally:
        if not task.done():
            task.cancel()


def create_app(llm: AsyncLLM | Callable[[], AsyncLLM], *, served_model_name: str, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
               shutdown_engine: bool | None = None) -> FastAPI:
    """The app. ``llm`` is an ``AsyncLLM`` or a factory for one; a factory runs in a background
    thread at start-up (``/health`` answers 503 until it returns). ``shutdown_engine`` (default: only
    when the app built the engine) shuts the engine down when the app stops."""
    state = ServerState(served_model_name, api_key or None, max_body_bytes, max_queue_len)
    factory = None if isinstance(llm, AsyncLLM) else llm
    if isinstance(llm, AsyncLLM):
        state.attach(llm)
    owns = factory is not None if shutdown_engine is None else shutdown_engine

    def load() -> None:
        assert factory is not None
        try:
            state.attach(factory())
        except BaseException as exc:
            logger.exception("loading the model failed")
            state.load_error = exc

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if factory is not None:
            threading.Thread(target=load, name="deepinfer-load", daemon=True).start()
        yield
        if owns and state.llm is not None:
            await asyncio.get_running_loop().run_in_executor(None, state.llm.shutdown)

    app = FastAPI(title="deepinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.deepinfer = state
    app.add_middleware(_CountResponses, metrics=state.metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        err = APIError(500, f"internal error: {exc!r}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.llm is not None and state.llm.is_running:
            return JSONResponse({"status": "ok"})
        if state.load_error is not None:
            return JSONResponse({"status": "failed", "error": repr(state.load_error)}, status_code=503)
        return JSONResponse({"status": "loading" if state.llm is None else "stopped"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = None
        if state.llm is not None:
            stats = await state.llm.get_stats_async()
        return PlainTextResponse(state.metrics.render(stats, state.inflight),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        state.check_auth(request)
        data = {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "deepinfer"}
        if state.llm is not None:
            data["max_model_len"] = state.llm.max_model_len
        return JSONResponse({"object": "list", "data": [data]})

    def start(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams, param: str, model: str,
              request_id: str) -> AsyncGenerator[RequestOutput, None]:
        try:
            gen = llm.generate(prompt, params, request_id=request_id)
        except ValueError as exc:
            raise bad_request(str(exc), param, "invalid_prompt") from exc
        state.check_model(model)
        state.admit()
        return gen

    def release() -> None:
        state.inflight -= 1

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        state.check_auth(request)
        body: CompletionRequest = parse_body(await read_body(request, state.max_body_bytes), CompletionRequest)
        params = body.to_sampling_params(16)
        prompt = body.the_prompt()
        llm = state.ready()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        gen = start(llm, prompt, params, "prompt", body.model, request_id)
        fmt = _Formatter(llm)
        created = int(time.time())
        want_lp = body.logprobs is not None

        def chunk(text: str, out: RequestOutput, lp: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
            return {"id": request_id, "object": "text_completion", "created": created, "model": body.model,
                    "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}

        if not body.stream:
            final = await _final_output(gen, request, release)
            if final is None:
                return Response(status_code=499)
            lp = fmt.completion_logprobs(final, 0, len(final.outputs[0].token_ids), 0) if want_lp else None
            payload = chunk(final.outputs[0].text, final, lp, _finish_reason(final))
            payload["usage"] = _usage(final)
            return JSONResponse(payload)

        def render(out: RequestOutput, text: str, first: int, last: int, finish: str | None,
                   sent: int) -> dict[str, Any] | None:
            if not (text or finish or (want_lp and last > first)):
                return None
            lp = fmt.completion_logprobs(out, first, last, sent - len(text)) if want_lp else None
            return chunk(text, out, lp, finish)

        usage = _usage_chunk(body, request_id, "text_completion", created)
        return _EventStream(_events(gen, params.stop, render, usage), release)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        state.check_auth(request)
        body: ChatRequest = parse_body(await read_body(request, state.max_body_bytes), ChatRequest)
        params = body.to_sampling_params(1)
        llm = state.ready()
        if body.max_tokens is None and body.max_completion_tokens is None:  # default: up to max_model_len
            params = replace(params, max_tokens=llm.max_model_len)
        if llm.tokenizer is None:
            raise bad_request("this model has no tokenizer, so chat is unavailable; use /v1/completions with "
                              "token ids", "messages")
        try:
            # The tokenizer's own chat encoding makes the ids, as LLM.chat does: for tokenizer="deepseek-v4"
            # that is deepseek-recipe's V4 encoding, which is not encode(render(...)) (tokenizer_deepseek.py).
            _, prompt = llm.tokenizer.encode_chat([m.as_dict() for m in body.messages],
                                                  **(body.chat_template_kwargs or {}))
        except ChatOptionError as exc:
            raise bad_request(str(exc), "chat_template_kwargs", "invalid_value") from exc
        except (ValueError, TemplateError) as exc:
            raise bad_request(f"the chat template failed: {exc}", "messages", "invalid_messages") from exc
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen = start(llm, prompt, params, "messages", body.model, request_id)
        fmt = _Formatter(llm)
        created = int(time.time())
        top_n = body.top_logprobs or 0

        def envelope(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
            return {"id": request_id, "object": obj, "created": created, "model": body.model, "choices": [choice]}

        if not body.stream:
            final = await _final_output(gen, request, release)
            if final is None:
                return Response(status_code=499)
            lp = fmt.chat_logprobs(final, 0, len(final.outputs[0].token_ids), top_n) if body.logprobs else None
            payload = envelope("chat.completion", {
                "index": 0, "message": {"role": "assistant", "content": final.outputs[0].text},
                "logprobs": lp, "finish_reason": _finish_reason(final)})
            payload["usage"] = _usage(final)
            return JSONResponse(payload)

        def render(out: RequestOutput, text: str, first: int, last: int, finish: str | None,
                   sent: int) -> dict[str, Any] | None:
            if not (text or finish or (body.logprobs and last > first)):
                return None
            lp = fmt.chat_logprobs(out, first, last, top_n) if body.logprobs else None
            return envelope("chat.completion.chunk", {"index": 0, "delta": {"content": text} if text else {},
                                                      "logprobs": lp, "finish_reason": finish})

        head = envelope("chat.completion.chunk", {"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None})
        usage = _usage_chunk(body, request_id, "chat.completion.chunk", created)
        return _EventStream(_events(gen, params.stop, render, usage, head), release)

    return app


def _usage_chunk(body: Any, request_id: str, obj: str, created: int
                 ) -> Callable[[RequestOutput], dict[str, Any]] | None:
    """The final ``usage`` chunk of a stream, when the client asked for it (``stream_options``)."""
    if body.stream_options is None or not body.stream_options.include_usage:
        return None
    return lambda out: {"id": request_id, "object": obj, "created": created, "model": body.model, "choices": [],
                        "usage": _usage(out)}


async def _events(gen: AsyncGenerator[RequestOutput, None], stop: list[str], render: Callable[..., Any],
                  usage: Callable[[RequestOutput], dict[str, Any]] | None,
                  head: dict[str, Any] | None = None) -> AsyncGenerator[str, None]:
    """Server-sent events of one streaming request. ``render(out, text, first, last, finish, sent)``
    builds the chunk for the text that became safe to send (or None to send nothing); ``usage`` adds
    the final usage chunk; a generation error becomes an error event; the stream always ends with
    ``[DONE]`` and closes the generator (which aborts the request if it is still running)."""
    delta = _Delta(stop)
    if head is not None:
        yield _sse(head)
    try:
        async for out in gen:
            if out.outputs[0].finish_reason == "error":
                yield _sse(APIError(500, f"generation failed: {out.outputs[0].error}", type="server_error").body())
                break
            text, first, last = delta.step(out)
            finish = _finish_reason(out) if out.finished else None
            payload = render(out, text, first, last, finish, len(delta.sent))
            if payload is not None:
                yield _sse(payload)
            if out.finished and usage is not None:
                yield _sse(usage(out))
    except RuntimeError as exc:
        yield _sse(APIError(500, str(exc), type="server_error").body())
    finally:
        await gen.aclose()
    yield "data: [DONE]\n\n"


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          api_key: str | None = None, config: Any = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          max_queue_len: int = DEFAULT_MAX_QUEUE_LEN, log_level: str = "info", **overrides: Any) -> None:
    """Load the model (errors surface here, before binding), then serve until interrupted."""
    import uvicorn

    llm = AsyncLLM(model, config=config, **overrides)
    app = create_app(llm, served_model_name=served_model_name or model, api_key=api_key,
                     max_body_bytes=max_body_bytes, max_queue_len=max_queue_len, shutdown_engine=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
