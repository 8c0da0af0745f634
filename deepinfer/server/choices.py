"""``n`` > 1: the choices of one request, each an engine request of its own, sharing the prompt's KV blocks
through the prefix cache.

Choice 0 is submitted alone; the others are submitted once its first output arrived, that is once its
prompt was prefilled and the prompt's full blocks were registered in the prefix cache (the block manager
registers a block when its tokens are computed, not when it is allocated, so requests added in the same
step would not share). Choices 1..n-1 then look the prompt up and take those blocks reference-counted
(``kv/blocks.py``: a hit block gains a reference, is freed when its last holder frees it); only the
prompt's last, partial block is recomputed for each. This costs choices 1..n-1 one step of latency and
needs prefix caching on (the default); without it each choice prefills the prompt itself. No fork of a
running request: the engine has no such operation, and this keeps the engine untouched.

Seeds: choice i samples with ``choice_seed(seed, i)``: choice 0 with the request's seed itself, choice
i > 0 with ``(seed + i * 0x9E3779B97F4A7C15) mod 2^64`` (a Weyl step of the golden ratio, so choice i's
seed is not that of a request seeded ``seed + i``). Without a seed every choice draws its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace

from deepinfer.outputs import RequestOutput
from deepinfer.sampling.params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15
_UINT64 = 1 << 64

Choice = tuple[int, RequestOutput]  # (choice index, that choice's cumulative output)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded ``seed`` (see the module docstring)."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _GOLDEN) % _UINT64


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """``params`` for each of ``n`` choices (their seeds derived by ``choice_seed``)."""
    return [params if i == 0 else replace(params, seed=choice_seed(params.seed, i), seq_seed=None)
            for i in range(n)]


async def merge_choices(first: AsyncGenerator[RequestOutput, None],
                        start_rest: Callable[[list[int]], Sequence[AsyncGenerator[RequestOutput, None]]],
                        n: int) -> AsyncGenerator[Choice, None]:
    """The outputs of all ``n`` choices as ``(index, output)``, in arrival order. ``first`` is choice 0's
    stream; ``start_rest(prompt_token_ids)`` starts choices 1..n-1 (called once choice 0's first output
    came). Closing this generator closes every choice's stream (which aborts the unfinished ones)."""
    if n == 1:
        try:
            async for out in first:
                yield 0, out
        finally:
            await first.aclose()
        return
    streams: list[AsyncGenerator[RequestOutput, None]] = [first]
    tasks: list[asyncio.Task[None]] = []
    try:
        head = await anext(first, None)
        if head is None:
            return
        yield 0, head
        streams += list(start_rest(head.prompt_token_ids))
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((index, out))
                queue.put_nowait((index, None))
            except Exception as exc:  # the engine stopped: hand it to the consumer
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        live = len(tasks)
        while live:
            index, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
