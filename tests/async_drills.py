"""Async callers shared by the ``AsyncLLM`` tests (one process and expert-parallel ranks): a caller that
collects a whole stream, one that is cancelled while it waits forever, one that breaks off early."""

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
