"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) over ``AsyncLLM``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` answers as
server-sent events), ``GET /v1/models``, ``GET /health`` (200 only once the model is loaded),
``GET /metrics`` (Prometheus text). The ``/v1`` endpoints check the API key when one is set;
``/metrics`` checks its own key only when one is set (``--metrics-api-key``).

Order of checks for a generation request: API key (401) → body size and arrival time (413, 408) →
JSON and fields (400) → sampling values and stop-string limits (400) → model loaded (503) → prompt
against the model: tokenization (on a worker thread), vocabulary, ``max_model_len`` (400) → model name
(404) → queue length (503); a structured request's grammar that fails to compile is a 400 too. A client
that disconnects aborts its request (streaming: the response task is cancelled; non-streaming: the
handler polls for the disconnect), which frees its KV blocks. Limits and their flags: docs/server.md.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2.exceptions import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepinfer.chat_output import ChatPrompt, encode_chat
from deepinfer.entrypoints.async_llm import AsyncLLM
from deepinfer.errors import ChatOptionError, ModelLoadError
from deepinfer.outputs import RequestOutput
from deepinfer.sampling.params import SamplingParams
from deepinfer.server.choices import Choice, choice_params, merge_choices
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.protocol import APIError, ChatRequest, CompletionRequest, bad_request, parse_body
from deepinfer.server.render import ChatChoice, Formatter, TextDelta, finish_reason
from deepinfer.server.stops import StopHoldBack

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_QUEUE_LEN = 1024
DEFAULT_BODY_TIMEOUT_S = 30.0  # the whole body must arrive within this (a slow sender is a 408)
DEFAULT_MAX_CONNECTIONS = 2048  # uvicorn's limit_concurrency: connections beyond it are answered 503
TOKENIZE_THREADS = 4  # tokenization and chat-template rendering run on these, never on the event loop
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class ServerState:
    """What the handlers share: the engine (once loaded), limits, metrics, the in-flight count."""

    def __init__(self, served_model_name: str, api_key: str | None, max_body_bytes: int,
                 max_queue_len: int, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 metrics_api_key: str | None = None) -> None:
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_queue_len = max_queue_len
        self.body_timeout_s = body_timeout_s
        self.metrics_api_key = metrics_api_key  # /metrics is open unless set (``--metrics-api-key``)
        # Prompts are tokenized and chat templates rendered here: a 1 MB prompt must not stall /health.
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="deepinfer-tokenize")
        self.metrics = ServerMetrics()
        self.llm: AsyncLLM | None = None
        self.load_error: BaseException | None = None
        self.inflight = 0
        self.created = int(time.time())

    def attach(self, llm: AsyncLLM) -> None:
        llm.finish_listeners.append(self.metrics.on_finish)
        self.llm = llm

    def check_auth(self, request: Request) -> None:
        """401 unless the request carries the ``/v1`` API key (when one is set)."""
        self.check_key(request, self.api_key)

    @staticmethod
    def check_key(request: Request, key: str | None) -> None:
        """401 unless the request's Bearer token is ``key`` (None: no key needed); constant-time compare."""
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(given, key.encode()):
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


async def read_body(request: Request, limit: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> bytes:
    """The body, at most ``limit`` bytes (413 beyond), all of it within ``timeout_s`` seconds (408 otherwise:
    a client that trickles its body must not hold a connection and a handler forever)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body has {length} bytes; the limit is {limit}", code="request_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"the request body is over the limit of {limit} bytes",
                                   code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout)",
                       code="request_timeout") from None
    except ClientDisconnect:  # nobody reads the answer; this keeps a traceback out of the log
        raise APIError(400, "the client disconnected before sending its whole body",
                       code="client_disconnected") from None
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


def _internal_error(request_id: str) -> APIError:
    """A 500 body that says where to look, never what went wrong inside (that is logged under the id)."""
    return APIError(500, f"internal server error (request id {request_id}; the details are in the server log)",
                    type="server_error", code="internal_error")


def _usage(outs: Sequence[RequestOutput]) -> dict[str, int]:
    """Usage of a request's choices: the prompt once (its blocks are shared), the completions summed."""
    p, c = len(outs[0].prompt_token_ids), sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _check_error(out: RequestOutput, params: SamplingParams, grammar_param: str = "response_format") -> None:
    refused = _grammar_refusal(out, params, grammar_param)
    if refused is not None:
        raise refused
    if out.outputs[0].finish_reason == "error":
        raise APIError(500, f"generation failed: {out.outputs[0].error}", type="server_error", code="engine_error")


def _grammar_refusal(out: RequestOutput, params: SamplingParams, param: str = "response_format") -> APIError | None:
    """The 400 for a structured request whose grammar failed to compile (or timed out compiling): it
    ends with ``finish_reason="error"`` before its first token. A later error is the engine's (500).
    ``param`` is the field the grammar came from (``response_format``, or ``tools`` for a forced call)."""
    comp = out.outputs[0]
    if params.grammar_spec is None or comp.finish_reason != "error" or comp.token_ids:
        return None
    return bad_request(f"{param}: {comp.error}", param, f"invalid_{param}")


async def _first_output(gen: AsyncGenerator[Choice, None], params: SamplingParams, release: Callable[[], None],
                        grammar_param: str) -> AsyncGenerator[Choice, None]:
    """A streaming structured request waits for its first output before anything is sent, so that a grammar
    that fails to compile is a 400 (as without streaming), not a 200 stream with an error event. Returns a
    generator that yields that output, then the rest (closing ``gen`` when it is closed)."""
    try:
        first = await anext(gen, None)
        refused = None if first is None else _grammar_refusal(first[1], params, grammar_param)
        if refused is not None:
            raise refused
    except BaseException:
        release()
        await gen.aclose()
        raise

    async def chained() -> AsyncGenerator[Choice, None]:
        try:
            if first is not None:
                yield first
            async for item in gen:
                yield item
        finally:
            await gen.aclose()

    return chained()


async def _last_outputs(gen: AsyncIterator[Choice], n: int) -> list[RequestOutput] | None:
    """Each choice's last output, by index (None if the stream ended early)."""
    last: dict[int, RequestOutput] = {}
    async for index, out in gen:
        last[index] = out
    return [last[i] for i in range(n)] if len(last) == n else None


async def _final_outputs(gen: AsyncGenerator[Choice, None], n: int, request: Request, params: SamplingParams,
                         release: Callable[[], None], grammar_param: str = "response_format"
                         ) -> list[RequestOutput] | None:
    """A non-streaming request's checked final outputs, one per choice (None: the client left), releasing
    its queue slot."""
    try:
        finals = await _run_unless_disconnected(gen, n, request)
    finally:
        release()
        await gen.aclose()
    for final in finals or ():
        _check_error(final, params, grammar_param)
    return finals


async def _run_unless_disconnected(gen: AsyncIterator[Choice], n: int,
                                   request: Request) -> list[RequestOutput] | None:
    """The final outputs, or None when the client went away (the request is then aborted)."""
    task = asyncio.ensure_future(_last_outputs(gen, n))
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
               metrics_api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_queue_len: int = DEFAULT_MAX_QUEUE_LEN, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               shutdown_engine: bool | None = None) -> FastAPI:
    """The app. ``llm`` is an ``AsyncLLM`` or a factory for one; a factory runs in a background
    thread at start-up (``/health`` answers 503 until it returns). ``shutdown_engine`` (default: only
    when the app built the engine) shuts the engine down when the app stops. ``api_key`` guards ``/v1``;
    ``/metrics`` is open (as in vLLM) unless ``metrics_api_key`` is set, then it needs that key."""
    state = ServerState(served_model_name, api_key or None, max_body_bytes, max_queue_len, body_timeout_s,
                        metrics_api_key or None)
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
        state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
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
        error_id = f"err-{uuid.uuid4().hex}"
        logger.error("request %s (%s %s): unhandled error", error_id, request.method, request.url.path,
                     exc_info=exc)
        return JSONResponse(_internal_error(error_id).body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.llm is not None and state.llm.is_running:
            return JSONResponse({"status": "ok"})
        if state.load_error is not None:  # the exception itself is in the server log, not in the answer
            return JSONResponse({"status": "failed", "error": "the model failed to load; see the server log"},
                                status_code=503)
        return JSONResponse({"status": "loading" if state.llm is None else "stopped"}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state.check_key(request, state.metrics_api_key)
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

    async def off_loop(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the tokenize pool (tokenization and template rendering are CPU work)."""
        return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool,
                                                                functools.partial(fn, *args, **kwargs))

    async def start(llm: AsyncLLM, prompt: str | list[int], params: list[SamplingParams], param: str, model: str,
                    request_id: str) -> AsyncGenerator[Choice, None]:
        """The request's choices (``params``: one per choice) as one stream of ``(index, output)``."""
        try:
            # ``generate`` tokenizes a text prompt and checks it against the model; the stream it returns
            # is iterated on the loop (it is bound to the loop only when iteration starts).
            gen = await off_loop(llm.generate, prompt, params[0], request_id=request_id)
        except ValueError as exc:
            raise bad_request(str(exc), param, "invalid_prompt") from exc
        state.check_model(model)
        state.admit()

        def start_rest(prompt_ids: list[int]) -> list[AsyncGenerator[RequestOutput, None]]:
            # The prompt is the first choice's ids (already checked); its full blocks are in the prefix cache.
            return [llm.generate(prompt_ids, p, request_id=f"{request_id}-{i}") for i, p in enumerate(params) if i]

        return merge_choices(gen, start_rest, len(params))

    def release() -> None:
        state.inflight -= 1

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        state.check_auth(request)
        body: CompletionRequest = parse_body(await read_body(request, state.max_body_bytes, state.body_timeout_s),
                                             CompletionRequest)
        params = body.to_sampling_params(16)
        prompt = body.the_prompt()
        llm = state.ready()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        gen = await start(llm, prompt, choice_params(params, body.n), "prompt", body.model, request_id)
        fmt = Formatter(llm.tokenizer)
        created = int(time.time())
        want_lp = body.logprobs is not None

        def choice(index: int, text: str, lp: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {"id": request_id, "object": "text_completion", "created": created, "model": body.model,
                    "choices": choices}

        if not body.stream:
            finals = await _final_outputs(gen, body.n, request, params, release)
            if finals is None:
                return Response(status_code=499)
            payload = envelope([
                choice(i, f.outputs[0].text,
                       fmt.completion_logprobs(f, 0, len(f.outputs[0].token_ids), 0) if want_lp else None,
                       finish_reason(f))
                for i, f in enumerate(finals)])
            payload["usage"] = _usage(finals)
            return JSONResponse(payload)

        deltas = [TextDelta(StopHoldBack(params.stop) if params.stop else None) for _ in range(body.n)]

        def render(index: int, out: RequestOutput) -> list[dict[str, Any]]:
            text, first, last = deltas[index].step(out)
            finish = finish_reason(out) if out.finished else None
            if not (text or finish or (want_lp and last > first)):
                return []
            lp = fmt.completion_logprobs(out, first, last, len(deltas[index].sent) - len(text)) if want_lp else None
            return [envelope([choice(index, text, lp, finish)])]

        usage = _usage_chunk(body, request_id, "text_completion", created)
        if params.grammar_spec is not None:
            gen = await _first_output(gen, params, release, "response_format")
        return _EventStream(_events(gen, body.n, render, usage, request_id=request_id), release)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        state.check_auth(request)
        body: ChatRequest = parse_body(await read_body(request, state.max_body_bytes, state.body_timeout_s),
                                       ChatRequest)
        params = body.to_sampling_params(1)
        llm = state.ready()
        if body.max_tokens is None and body.max_completion_tokens is None:  # default: up to max_model_len
            params = replace(params, max_tokens=llm.max_model_len)
        if llm.tokenizer is None:
            raise bad_request("this model has no tokenizer, so chat is unavailable; use /v1/completions with "
                              "token ids", "messages")
        native = hasattr(llm.tokenizer, "chat_request")  # deepseek-recipe encodes, and parses the replies
        options, fields = _chat_options(body, native)
        try:
            # The tokenizer's own chat encoding makes the ids, as LLM.chat does: for tokenizer="deepseek-v4"
            # that is deepseek-recipe's V4 encoding, which is not encode(render(...)) (tokenizer_deepseek.py).
            chat = await off_loop(encode_chat, llm.tokenizer, [m.as_dict() for m in body.messages], options, fields)
        except ChatOptionError as exc:
            raise bad_request(str(exc), "chat_template_kwargs", "invalid_value") from exc
        except ModelLoadError:
            raise  # the model folder's template is broken: a 500 (logged), not the client's fault
        except (ValueError, TemplateError) as exc:
            raise bad_request(f"the chat template failed: {exc}", _rejected_field(str(exc), body),
                              "invalid_messages") from exc
        params, forced, grammar_param = _chat_sampling(body, params, chat)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen = await start(llm, chat.token_ids, choice_params(params, body.n), "messages", body.model, request_id)
        fmt = Formatter(llm.tokenizer)
        created = int(time.time())
        skip = llm.engine.intake.eos_token_ids | frozenset(params.stop_token_ids)
        holdback = params.stop if body.stream and params.stop else None
        choices = [ChatChoice(i, fmt, parser=chat.reply_stream(skip_ids=skip, stop=params.stop), forced=forced,
                              holdback=StopHoldBack(holdback) if holdback else None,
                              logprobs=(body.top_logprobs or 0) if body.logprobs else None)
                   for i in range(body.n)]

        def envelope(obj: str, items: list[dict[str, Any]]) -> dict[str, Any]:
            return {"id": request_id, "object": obj, "created": created, "model": body.model, "choices": items}

        if not body.stream:
            finals = await _final_outputs(gen, body.n, request, params, release, grammar_param)
            if finals is None:
                return Response(status_code=499)
            payload = envelope("chat.completion", [c.final(f) for c, f in zip(choices, finals, strict=True)])
            payload["usage"] = _usage(finals)
            return JSONResponse(payload)

        def render(index: int, out: RequestOutput) -> list[dict[str, Any]]:
            return [envelope("chat.completion.chunk", [item]) for item in choices[index].step(out)]

        head = envelope("chat.completion.chunk", [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None} for i in range(body.n)])
        usage = _usage_chunk(body, request_id, "chat.completion.chunk", created)
        if params.grammar_spec is not None:
            gen = await _first_output(gen, params, release, grammar_param)
        return _EventStream(_events(gen, body.n, render, usage, head, request_id=request_id), release)

    return app


def _chat_options(body: ChatRequest, native: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The chat encoding's options and (deepseek-recipe only) the further request fields it reads.

    With deepseek-recipe (``native``) tools, ``tool_choice`` and ``reasoning_effort`` go to its conversion,
    and ``temperature`` / ``top_p`` too (it resolves them: thinking mode fixes both). Otherwise the model has
    no tool-call format: ``tool_choice`` ``auto`` is refused (there is nothing to parse calls with), ``none``
    drops the tools, and a forced function reaches the template as the ``tools`` variable (HF's convention)."""
    options = dict(body.chat_template_kwargs or {})
    tools = [t.as_dict() for t in body.tools or ()]
    choice = body.tool_choice
    if native:
        if tools:
            options["tools"] = tools
            if choice is not None:
                options["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
        if body.reasoning_effort is not None:
            options["reasoning_effort"] = body.reasoning_effort
        fields = {"temperature": body.temperature, "top_p": body.top_p}
        if body.response_format is not None and body.response_format.type != "text":
            fields["response_format"] = body.response_format.model_dump(exclude_none=True)
        return options, fields
    if body.reasoning_effort is not None:
        raise bad_request("reasoning_effort needs a model whose replies are parsed for reasoning "
                          "(tokenizer='deepseek-v4')", "reasoning_effort")
    if tools and choice in (None, "auto"):
        raise bad_request("tool_choice 'auto' needs a model with a tool-call format (tokenizer='deepseek-v4'); "
                          "give 'required' or a named function (constrained to its parameters), or 'none'",
                          "tool_choice", "invalid_tool_choice")
    if tools and choice != "none":
        options.setdefault("tools", tools)
    return options, None


def _chat_sampling(body: ChatRequest, params: SamplingParams, chat: ChatPrompt
                   ) -> tuple[SamplingParams, str | None, str]:
    """``params`` under the chat's rules: deepseek-recipe's resolved temperature / top_p and its output
    constraint (``tool_call_required``, ``json``); or, without the recipe, a forced function's parameter schema.
    Returns the params, the forced function's name (None: no forced call) and the field a grammar came from."""
    grammar_param = "response_format"
    tools_grammar = None
    forced = None
    if chat.parses_replies:
        # The recipe read response_format too (its prompt asks for JSON): its constraint replaces ours.
        params = replace(params, structured=None, **chat.sampling_rules())
        constraint = chat.constraint()
        if constraint is not None:
            grammar_param, fields = constraint
            try:
                params = replace(params, **fields)
            except ValueError as exc:
                raise bad_request(f"{grammar_param}: {exc}", grammar_param, f"invalid_{grammar_param}") from exc
        return params, None, grammar_param
    if body.tool_choice not in (None, "none") and body.tools:
        function = body.forced_function()
        if function is None:
            raise bad_request("tool_choice 'required' with several tools needs a model with a tool-call format "
                              "(tokenizer='deepseek-v4'); name one function", "tool_choice", "invalid_tool_choice")
        forced = function.name
        tools_grammar = {"json_schema": function.parameters or {"type": "object"}}
    if tools_grammar is not None:
        if params.grammar_spec is not None:
            raise bad_request("response_format cannot constrain a reply whose tool_choice forces a tool call",
                              "response_format")
        try:
            params = replace(params, structured=tools_grammar)
        except ValueError as exc:
            raise bad_request(f"tools: {exc}", "tools", "invalid_tools") from exc
        grammar_param = "tools"
    return params, forced, grammar_param


def _rejected_field(message: str, body: ChatRequest) -> str:
    """The field a chat-encoding refusal is about: deepseek-recipe names a tool's bad schema ("Invalid schema
    for function ..."), a ``tool_choice`` naming no declared function ("no function named ...") or one that
    thinking mode does not support, and a bad ``response_format``."""
    if body.tools and "invalid schema for function" in message.lower():
        return "tools"
    lowered = message.lower()
    if body.tool_choice is not None and ("no function named" in lowered or "tool_choice" in lowered):
        return "tool_choice"
    if body.response_format is not None and ("response_format" in lowered or "json_schema" in lowered):
        return "response_format"
    return "messages"


def _usage_chunk(body: Any, request_id: str, obj: str, created: int
                 ) -> Callable[[list[RequestOutput]], dict[str, Any]] | None:
    """The final ``usage`` chunk of a stream, when the client asked for it (``stream_options``)."""
    if body.stream_options is None or not body.stream_options.include_usage:
        return None
    return lambda outs: {"id": request_id, "object": obj, "created": created, "model": body.model, "choices": [],
                         "usage": _usage(outs)}


async def _events(gen: AsyncGenerator[Choice, None], n: int, render: Callable[[int, RequestOutput], list[Any]],
                  usage: Callable[[list[RequestOutput]], dict[str, Any]] | None,
                  head: dict[str, Any] | None = None, *, request_id: str = "") -> AsyncGenerator[str, None]:
    """Server-sent events of one streaming request of ``n`` choices. ``render(index, out)`` builds the chunks
    that choice's new output makes available (text held back until it is safe to send); ``usage`` adds the
    final usage chunk once every choice finished; a generation error becomes an error event; the stream
    always ends with ``[DONE]`` and closes the generator (which aborts the choices still running)."""
    if head is not None:
        yield _sse(head)
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, out in gen:
            if out.outputs[0].finish_reason == "error":
                yield _sse(APIError(500, f"generation failed: {out.outputs[0].error}", type="server_error").body())
                break
            for payload in render(index, out):
                yield _sse(payload)
            if out.finished:
                finals[index] = out
                if len(finals) == n and usage is not None:
                    yield _sse(usage([finals[i] for i in range(n)]))
    except RuntimeError:
        # The engine stopped (a failure, or a shutdown): the details go to the log, not to the client.
        logger.exception("request %s: the stream failed", request_id)
        yield _sse(_internal_error(request_id).body())
    finally:
        await gen.aclose()
    yield "data: [DONE]\n\n"


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          api_key: str | None = None, metrics_api_key: str | None = None, config: Any = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
          body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS,
          log_level: str = "info", **overrides: Any) -> None:
    """Load the model (errors surface here, before binding), then serve until interrupted.
    ``max_connections`` is uvicorn's ``limit_concurrency`` (connections and tasks beyond it get a 503)."""
    import uvicorn

    llm = AsyncLLM(model, config=config, **overrides)
    app = create_app(llm, served_model_name=served_model_name or model, api_key=api_key,
                     metrics_api_key=metrics_api_key, max_body_bytes=max_body_bytes, max_queue_len=max_queue_len,
                     body_timeout_s=body_timeout_s, shutdown_engine=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, limit_concurrency=max_connections)
