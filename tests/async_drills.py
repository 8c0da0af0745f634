"""Async callers shared by the ``AsyncLLM`` tests (one process and expert-parallel ranks): a caller that
collects a whole stream, one that is cancelled while it waits forever, one that breaks off early, one
that aborts its own request by id mid-stream."""

from __future__ import annotations

from typing import Any

from deepinfer import SamplingParams
from deepinfer.entrypoints.async_llm import AsyncLLM


async def collect(llm: AsyncLLM, prompt: Any, params: SamplingParams, **kw: Any) -> list[Any]:
    """Every output the stream of ``prompt`` yields."""
    return [out async for out in llm.generate(prompt, params, **kw)]


async def consume_forever(llm: AsyncLLM, prompt: str, params: SamplingParams) -> None:
    """Read the stream to its end (the test cancels this caller's task first)."""
    async for _ in llm.generate(prompt, params):
        pass


async def break_early(llm: AsyncLLM, prompt: str, params: SamplingParams, after: int = 3) -> int:
    """Leave the stream after ``after`` outputs; returns how many were read."""
    n = 0
    async for _ in llm.generate(prompt, params):
        n += 1
        if n == after:
            break
    return n


async def abort_midway(llm: AsyncLLM, prompt: str, params: SamplingParams, request_id: str, after: int = 2) -> Any:
    """Stream ``prompt`` as ``request_id``, abort it by id after ``after`` outputs (the abort must find it)
    and return the stream's last output."""
    outs = []
    async for out in llm.generate(prompt, params, request_id=request_id):
        outs.append(out)
        if len(outs) == after:
            assert await llm.abort(request_id)
    return outs[-1]
