"""``AsyncLLM``: the engine behind an asyncio front, for servers (API.md §4).

One background thread owns the engine (which is not thread-safe) and runs ``engine.step()`` while
there is work; every caller's request joins the same continuous batch. The engine is the one ``LLM``
would build from the same arguments (``entrypoints.llm.Engine``): one process, or with
``expert_parallel_size=N`` a ``ParallelEngine`` driving N rank processes. Callers hand new requests,
aborts and stats calls to that thread through a queue; the thread hands each step's outputs back to
the caller's event loop (the engine's ``stream`` is on, so every request that got a token this step
gets an output). Prompts and params are validated in the caller (``engine.make_request``) before
anything is queued, so a bad request raises in that caller alone. A caller that stops iterating (a
disconnect, a cancelled task, ``break``) aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any

from deepinfer.engine.request import Request
from deepinfer.entrypoints.llm import Engine, create_engine
from deepinfer.errors import ConfigError
from deepinfer.outputs import RequestOutput
from deepinfer.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class _Stream:
    """Where one request's outputs go: a queue owned by the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    user_id: str

    def put(self, item: RequestOutput | BaseException) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            return False


class AsyncLLM:
    """Streaming generation for many concurrent callers on one engine (same constructor as ``LLM``).

    ``async for out in llm.generate(prompt, params, request_id=None)`` yields ``RequestOutput``s with
    cumulative ``text`` / ``token_ids`` as tokens arrive; the last one has ``finished=True``. When the
    caller is slower than the engine, intermediate outputs are coalesced (only the newest is yielded).
    ``generate`` validates at call time (``ValueError`` naming the problem) and queues the request when
    iteration starts.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *, config: Any = None,
                 **overrides: Any) -> None:
        from deepinfer.config import overrides_to_tree
        from deepinfer.parallel.launch import torchrun_launch

        launch = torchrun_launch()
        if launch is not None and launch.world > 1:
            # Under torchrun every process must issue the same engine commands; one server cannot.
            raise ConfigError(f"AsyncLLM runs in one process, but torchrun started {launch.world}; serve with "
                              "expert_parallel_size=N from a plain process (it starts the N ranks itself)")
        self.engine: Engine = create_engine(None if model is None else str(model), config,
                                            overrides_to_tree(overrides))
        self.engine.stream = True
        # Called on the engine thread with every finished output (aborts included), e.g. for metrics.
        self.finish_listeners: list[Callable[[RequestOutput], None]] = []
        self._lock = threading.Lock()  # guards make_request (the engine's request counter) and _ids
        self._ids: dict[str, str] = {}  # caller's request id -> the engine's (unique) request id
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine request id -> stream; engine thread only
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="deepinfer-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ public API

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive and accepting requests."""
        return not self._closed and self._error is None and self._thread.is_alive()

    def make_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Request:
        """Validate ``prompt`` and ``sampling_params`` against the model (``ValueError`` naming the
        problem); nothing is queued. ``generate`` calls this."""
        self._check_running()
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, (list, tuple)):
            prompt = list(prompt)
        elif not isinstance(prompt, str):
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        with self._lock:
            return self.engine.make_request(prompt, params)

    def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs. Raises ``ValueError`` here, before anything is queued, for a
        bad prompt or params or a ``request_id`` already in use."""
        req = self.make_request(prompt, sampling_params)
        user_id = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        if not isinstance(user_id, str):
            raise ValueError(f"request_id must be a str, got {type(user_id).__name__}")
        with self._lock:
            if user_id in self._ids:
                raise ValueError(f"request_id {user_id!r} is already in use")
        return self._generate(req, user_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request by the id given to ``generate``; its stream ends with ``finish_reason="abort"``.
        Returns False if no such request is live."""
        with self._lock:
            engine_id = self._ids.get(request_id)
        if engine_id is None:
            return False
        self._inbox.put(("abort", engine_id))
        return True

    def get_stats(self, timeout: float | None = 60.0) -> dict[str, Any]:
        """``engine.get_stats()`` (``num_running`` / ``num_waiting`` included), read on the engine thread
        between steps (blocks the calling thread for at most one step)."""
        if not self._thread.is_alive():
            return self.engine.get_stats()
        return self._call(self.engine.get_stats).result(timeout)

    async def get_stats_async(self) -> dict[str, Any]:
        """``get_stats()`` without blocking the event loop."""
        if not self._thread.is_alive():
            return self.engine.get_stats()
        return await asyncio.wrap_future(self._call(self.engine.get_stats))

    def shutdown(self) -> None:
        """Stop the engine thread: live requests are aborted and their streams raise ``RuntimeError``."""
        if not self._closed:
            self._closed = True
            self._inbox.put(("stop",))
            self._thread.join()
            self.engine.shutdown()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------------ caller side

    def _check_running(self) -> None:
        if self._closed:
            raise RuntimeError("AsyncLLM is shut down")
        if self._error is not None:
            raise RuntimeError(f"the engine loop failed: {self._error!r}")

    def _call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._inbox.put(("call", fn, future))
        return future

    async def _generate(self, req: Request, user_id: str) -> AsyncGenerator[RequestOutput, None]:
        self._check_running()
        with self._lock:
            if user_id in self._ids:
                raise ValueError(f"request_id {user_id!r} is already in use")
            self._ids[user_id] = req.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), user_id)
        finished = False
        try:
            self._inbox.put(("add", req, stream))
            while True:
                item = await stream.queue.get()
                while not stream.queue.empty() and not isinstance(item, BaseException):
                    item = stream.queue.get_nowait()  # coalesce: outputs are cumulative
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._ids.pop(user_id, None)
            if not finished:  # the caller stopped listening: free the request's blocks
                self._inbox.put(("abort", req.request_id))

    # ------------------------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                if not engine.has_unfinished() and not self._handle(self._inbox.get()):
                    return
                while True:
                    try:
                        command = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(command):
                        return
                if engine.has_unfinished():
                    self._dispatch(engine.step())
        except BaseException as exc:  # a bug or a device failure: fail every live stream, stop
            logger.exception("the engine loop failed")
            self._error = exc
            self._fail_all(RuntimeError(f"the engine loop failed: {exc!r}"))

    def _handle(self, command: tuple[Any, ...]) -> bool:
        """Apply one command on the engine thread; False means stop."""
        kind = command[0]
        if kind == "add":
            _, req, stream = command
            self._streams[req.request_id] = stream
            self.engine.add(req)
        elif kind == "abort":
            self.engine.abort(command[1])  # its output (finish_reason="abort") comes with the next step
        elif kind == "call":
            _, fn, future = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
        elif kind == "stop":
            self._fail_all(RuntimeError("AsyncLLM was shut down"))
            self._drain_calls()
            return False
        return True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                for listener in self.finish_listeners:
                    try:
                        listener(out)
                    except Exception:
                        logger.exception("a finish listener failed")
                stream = self._streams.pop(out.request_id, None)
            else:
                stream = self._streams.get(out.request_id)
            if stream is not None and not stream.put(_snapshot(out, stream.user_id)) and not out.finished:
                self.engine.abort(out.request_id)
                self._streams.pop(out.request_id, None)

    def _fail_all(self, error: BaseException) -> None:
        for engine_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(engine_id)
            except Exception:
                logger.exception("abort of request %s failed", engine_id)
            stream.put(error)
        self._streams.clear()

    def _drain_calls(self) -> None:
        """Answer calls still queued at stop (``get_stats``) so no caller waits forever."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "call":
                self._handle(command)
            elif command[0] == "add":
                command[2].put(RuntimeError("AsyncLLM was shut down"))


def _snapshot(out: RequestOutput, request_id: str) -> RequestOutput:
    """A copy the engine will not mutate later (the request's logprob lists and metrics keep
    changing while it runs), under the caller's request id."""
    completion = out.outputs[0]
    logprobs = None if completion.logprobs is None else list(completion.logprobs)
    return replace(
        out,
        request_id=request_id,
        outputs=[replace(completion, token_ids=list(completion.token_ids), logprobs=logprobs)],
        metrics=replace(out.metrics),
        prompt_logprobs=None if out.prompt_logprobs is None else list(out.prompt_logprobs),
    )
