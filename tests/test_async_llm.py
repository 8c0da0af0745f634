"""``AsyncLLM`` (API.md §4): streaming outputs, many callers in one batch with the same greedy tokens
as ``LLM.generate``, per-caller validation errors, aborts by id, by cancellation and by ``break``
(no KV block leaks), and shutdown."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from async_drills import abort_midway, break_early, collect, consume_forever

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.async_llm import AsyncLLM

pytestmark = pytest.mark.usefixtures("clean_deepinfer_env")

ENGINE = {"kv_cache_bytes": 4 << 20, "block_size": 16}
PROMPTS = ["Hello there", "The capital of France is", "1 2 3 4", "Once upon a time", "a", "Write a poem",
           "The ocean is", "Tea or coffee?"]


@pytest.fixture(scope="module")
def async_llm(tiny_llama_tok_dir: Path) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(tiny_llama_tok_dir, **ENGINE)
    yield llm
    llm.shutdown()


def assert_no_leak(llm: AsyncLLM) -> None:
    stats = llm.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_streams_cumulative_outputs(async_llm: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = asyncio.run(collect(async_llm, "Hello there", params, request_id="stream-1"))
    assert len(outs) >= 2 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert all(o.request_id == "stream-1" for o in outs)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 8
    for earlier, later in itertools.pairwise(outs):  # cumulative: each output extends the last
        assert later.outputs[0].token_ids[: len(earlier.outputs[0].token_ids)] == earlier.outputs[0].token_ids
        assert len(earlier.outputs[0].logprobs) == len(earlier.outputs[0].token_ids)  # a snapshot, not live
    final = outs[-1].outputs[0]
    assert final.finish_reason == "length" and len(final.logprobs) == 8
    assert outs[-1].metrics.first_token_time is not None
    assert_no_leak(async_llm)


def test_concurrent_callers_match_offline_greedy(async_llm: AsyncLLM, tiny_llama_tok_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=6)

    async def run_all() -> list[Any]:
        return await asyncio.gather(*(collect(async_llm, p, params) for p in PROMPTS))

    streamed = asyncio.run(run_all())
    with LLM(tiny_llama_tok_dir, **ENGINE) as offline:
        expected = offline.generate(PROMPTS, params, use_tqdm=False)
    for outs, exp in zip(streamed, expected, strict=True):
        assert outs[-1].outputs[0].token_ids == exp.outputs[0].token_ids
        assert outs[-1].outputs[0].text == exp.outputs[0].text
        assert outs[-1].outputs[0].finish_reason == exp.outputs[0].finish_reason
    assert async_llm.get_stats()["steps"] > 0
    assert_no_leak(async_llm)


def test_bad_request_raises_in_its_caller_only(async_llm: AsyncLLM) -> None:
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run() -> None:
        task = asyncio.ensure_future(collect(async_llm, "fine prompt", good))
        with pytest.raises(ValueError, match="empty"):
            async_llm.generate("", good)
        with pytest.raises(ValueError, match="max_model_len"):
            async_llm.generate([5] * 600, good)
        with pytest.raises(ValueError, match="vocabulary"):
            async_llm.generate([10**9], good)
        with pytest.raises(ValueError, match="SamplingParams"):
            async_llm.generate("x", "not params")  # type: ignore[arg-type]
        outs = await task
        assert outs[-1].outputs[0].finish_reason == "length"

    asyncio.run(run())
    assert_no_leak(async_llm)


def test_duplicate_request_id_is_rejected(async_llm: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def run() -> None:
        gen = async_llm.generate("first", params, request_id="dup")
        first = await anext(gen)
        assert first.request_id == "dup"
        with pytest.raises(ValueError, match="already in use"):
            async_llm.generate("second", params, request_id="dup")
        await gen.aclose()  # stopping early aborts the request
        outs = await collect(async_llm, "again", SamplingParams(max_tokens=2), request_id="dup")  # id free again
        assert outs[-1].finished

    asyncio.run(run())
    assert_no_leak(async_llm)


def test_abort_by_id_ends_the_stream(async_llm: AsyncLLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run() -> Any:
        last = await abort_midway(async_llm, "abort me", params, "victim")
        assert not await async_llm.abort("no-such-request")
        return last

    last = asyncio.run(run())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert len(last.outputs[0].token_ids) < 400
    assert_no_leak(async_llm)


def test_cancelled_and_abandoned_callers_free_their_blocks(async_llm: AsyncLLM) -> None:
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def run() -> None:
        tasks = [asyncio.ensure_future(consume_forever(async_llm, f"cancel me {i}", long)) for i in range(4)]
        survivors = [asyncio.ensure_future(collect(async_llm, p, short)) for p in PROMPTS[:4]]
        broke = await asyncio.gather(*(break_early(async_llm, f"break {i}", long) for i in range(4)))
        assert broke == [3, 3, 3, 3]
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in await asyncio.gather(*survivors):
            assert s[-1].outputs[0].finish_reason == "length" and len(s[-1].outputs[0].token_ids) == 5

    asyncio.run(run())
    for _ in range(200):  # aborts are applied by the engine thread; give it a moment
        stats = async_llm.get_stats()
        if stats["num_running"] == stats["num_waiting"] == 0:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert_no_leak(async_llm)


def test_shutdown_fails_live_streams_and_later_calls(tiny_llama_tok_dir: Path) -> None:
    llm = AsyncLLM(tiny_llama_tok_dir, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run() -> None:
        gen = llm.generate("long one", params)
        await anext(gen)
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in gen:
                pass

    asyncio.run(run())
    assert not llm.is_running
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("after", params)
    stats = llm.get_stats()  # answered directly once the thread is gone
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
