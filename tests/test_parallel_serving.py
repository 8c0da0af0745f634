"""Serving and speculative decoding with expert-parallel ranks (2 CPU rank processes, gloo): ``AsyncLLM``
streams the single-process greedy outputs (partial outputs from the ranks' token deltas, logprobs
included), a bad request fails in its caller alone, aborts by id / cancellation / ``break`` give every
KV block back on every rank; structured outputs (JSON schema, choice) equal the single process's and a
schema that does not compile fails alone; the OpenAI-compatible server answers a completion and a chat from the
ranks (and ``/metrics`` reads their summed counters); with ``plugins.spec_decode`` (``ngram`` under the
``varlen`` plan, ``oracle`` under ``fixed``, and ``mtp`` on a checkpoint with MTP weights) greedy ids
equal the single process without speculation; merged rank statistics weight spec decode's means by
verifies; ``AsyncLLM`` refuses to be one of several ``torchrun`` processes."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from async_drills import abort_midway, break_early, collect, consume_forever
from spec_setup import repeating_prompts, spec_plugins, write_oracle_file
from test_server import ServerThread
from tiny_deepseek import save_tiny_v3

from conftest import SMOLLM2_ALIAS, SMOLLM2_VOCAB, TOKENIZER_FILES
from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.async_llm import AsyncLLM
from deepinfer.errors import ConfigError
from deepinfer.parallel.driver import _sum_dicts
from deepinfer.server.app import create_app

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread", "clean_deepinfer_env")]

ENGINE = {"kv_cache_bytes": 1 << 22, "block_size": 16}
NAME = "tiny-v3"
PROMPTS = ["Hello there", "The capital of France is", "1 2 3 4", "Once upon a time", "Tea or coffee?"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny_v3_tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-V3 of ``tiny_deepseek`` with SmolLM2's vocabulary and tokenizer (str prompts, chat)."""
    from deepinfer.model.assets import resolve_model_path

    folder = save_tiny_v3(tmp_path_factory.mktemp("tiny-v3-tok"), vocab_size=SMOLLM2_VOCAB)
    smol = resolve_model_path(SMOLLM2_ALIAS)
    for name in TOKENIZER_FILES:
        if (smol / name).is_file():
            shutil.copy(smol / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def single(tiny_v3_tok: Path) -> Iterator[LLM]:
    """The single-process engine: the reference outputs."""
    with LLM(tiny_v3_tok, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def async_ep2(tiny_v3_tok: Path) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(tiny_v3_tok, expert_parallel_size=2, **ENGINE)
    yield llm
    llm.shutdown()


def wait_drained(llm: AsyncLLM, timeout: float = 30) -> dict[str, Any]:
    """The summed rank counters once no request is queued or running (aborts are applied by the
    engine thread at its next step)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.get_stats()
        if stats["num_running"] == stats["num_waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the ranks did not drain: {stats}"
        time.sleep(0.02)


def assert_no_leak(llm: AsyncLLM) -> None:
    stats = wait_drained(llm)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_async_streams_from_two_ranks_equal_generate(async_ep2: AsyncLLM, single: LLM) -> None:
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False)

    async def run() -> list[list[Any]]:
        streams = [asyncio.ensure_future(collect(async_ep2, p, GREEDY, request_id=f"s{i}"))
                   for i, p in enumerate(PROMPTS)]
        with pytest.raises(ValueError, match="vocabulary"):  # a bad request fails in its caller alone
            async_ep2.generate([10**9], GREEDY)
        return await asyncio.gather(*streams)

    streamed = asyncio.run(run())
    for i, (outs, exp) in enumerate(zip(streamed, expected, strict=True)):
        assert len(outs) >= 2 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert all(o.request_id == f"s{i}" for o in outs)
        for earlier, later in itertools.pairwise(outs):  # cumulative, each a snapshot
            n = len(earlier.outputs[0].token_ids)
            assert later.outputs[0].token_ids[:n] == earlier.outputs[0].token_ids
            assert later.outputs[0].logprobs[:n] == earlier.outputs[0].logprobs
            assert len(earlier.outputs[0].logprobs) == n
            assert later.outputs[0].text.startswith(earlier.outputs[0].text)
        final, ref = outs[-1].outputs[0], exp.outputs[0]
        assert final.token_ids == ref.token_ids and final.text == ref.text
        assert final.finish_reason == ref.finish_reason == "length"
        assert [set(d) for d in final.logprobs] == [set(d) for d in ref.logprobs]
        assert outs[0].metrics.first_token_time is not None
    stats = async_ep2.get_stats()
    assert stats["parallel"]["world_size"] == 2 and sum(stats["parallel"]["requests_per_rank"]) >= len(PROMPTS)
    assert_no_leak(async_ep2)


def test_aborts_mid_stream_free_every_block_on_every_rank(async_ep2: AsyncLLM, single: LLM) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = single.generate(PROMPTS[:2], short, use_tqdm=False)

    async def run() -> tuple[Any, list[list[Any]]]:
        cancelled = [asyncio.ensure_future(consume_forever(async_ep2, f"cancel me {i}", long)) for i in range(3)]
        survivors = [asyncio.ensure_future(collect(async_ep2, p, short)) for p in PROMPTS[:2]]
        aborted = await abort_midway(async_ep2, "abort me", long, "victim")
        assert await asyncio.gather(*(break_early(async_ep2, f"break {i}", long) for i in range(3))) == [3, 3, 3]
        for task in cancelled:
            task.cancel()
        await asyncio.gather(*cancelled, return_exceptions=True)
        return aborted, await asyncio.gather(*survivors)

    aborted, survived = asyncio.run(run())
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) < long.max_tokens
    for outs, exp in zip(survived, expected, strict=True):
        assert outs[-1].outputs[0].token_ids == exp.outputs[0].token_ids
    assert_no_leak(async_ep2)


def test_server_answers_a_completion_and_a_chat_from_two_ranks(async_ep2: AsyncLLM, single: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=8)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    completion_ref = single.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    chat_ref = single.chat(messages, params, use_tqdm=False)[0].outputs[0]
    server = ServerThread(create_app(async_ep2, served_model_name=NAME))  # the engine outlives the app
    try:
        server.wait_healthy()
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == completion_ref.text
        chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == chat_ref.text
        assert chat.choices[0].finish_reason == ("length" if chat_ref.finish_reason == "length" else "stop")
        assert chat.usage.completion_tokens == len(chat_ref.token_ids)
        stats = wait_drained(async_ep2)
        status, text = server.http("GET", "/metrics")
        assert status == 200
        assert f"deepinfer_kv_blocks_total {stats['kv_blocks_total']}" in text
        assert 'deepinfer_requests_total{finish_reason="length"} 2' in text
    finally:
        server.stop()
    assert async_ep2.is_running
    assert_no_leak(async_ep2)


def test_structured_outputs_from_two_ranks_equal_one_process(async_ep2: AsyncLLM, single: LLM) -> None:
    """A JSON-schema and a choice request give the single process's outputs (their grammars compile on
    the rank that runs them); a schema that does not compile fails its request alone, with the single
    process's error, and the next structured request runs."""
    pytest.importorskip("xgrammar")
    colors = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}
    cities = ["Paris", "London", "Rome"]
    params = [SamplingParams(temperature=0, max_tokens=24, structured={"json_schema": colors}),
              SamplingParams(temperature=0, max_tokens=8, structured={"choice": cities}),
              SamplingParams(temperature=0, max_tokens=24, structured={"json_schema": '{"type": "object", '}),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    prompts = PROMPTS[:len(params)]
    expected = [o.outputs[0] for o in single.generate(prompts, params, use_tqdm=False)]

    async def run() -> list[list[Any]]:
        return await asyncio.gather(*(collect(async_ep2, p, sp) for p, sp in zip(prompts, params, strict=True)))

    def error(text: str | None) -> str | None:
        return None if text is None else re.sub(r"\[\d\d:\d\d:\d\d\] ", "", text)  # xgrammar stamps the time

    got = [outs[-1].outputs[0] for outs in asyncio.run(run())]
    for out, ref in zip(got, expected, strict=True):
        assert (out.token_ids, out.text, out.finish_reason, error(out.error)) == (
            ref.token_ids, ref.text, ref.finish_reason, error(ref.error))
    assert json.loads(got[0].text)["color"] in colors["properties"]["color"]["enum"]
    assert got[1].text in cities and got[0].finish_reason == got[1].finish_reason == "stop"
    assert got[2].finish_reason == "error" and "failed to compile" in got[2].error and got[2].token_ids == []
    assert got[3].finish_reason == "length"
    after = asyncio.run(collect(async_ep2, PROMPTS[4], params[1]))[-1].outputs[0]
    assert after.text == single.generate(PROMPTS[4], params[1], use_tqdm=False)[0].outputs[0].text
    assert after.text in cities
    assert_no_leak(async_ep2)


@pytest.fixture(scope="module")
def spec_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[SamplingParams],
                                                                      list[list[int]]]:
    """The 256-token tiny DeepSeek-V3 (tokens repeat often enough for n-gram drafts), prompts, params and
    the single process's greedy ids without speculation."""
    folder = save_tiny_v3(tmp_path_factory.mktemp("tiny-v3-spec"))
    prompts = repeating_prompts(4, seed=3, low=3)
    params = [SamplingParams(temperature=0, max_tokens=16 + 4 * i, ignore_eos=True) for i in range(4)]
    with LLM(folder, **ENGINE) as plain:
        reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    return folder, prompts, params, reference


@pytest.mark.parametrize(("drafter", "plan"), [("ngram", "varlen"), ("oracle", "fixed")])
def test_spec_decode_with_two_ranks_gives_the_single_process_greedy_ids(spec_reference, drafter: str, plan: str,
                                                                        tmp_path: Path) -> None:
    """``ngram`` (every 1- to 4-gram looked up) under ``varlen``, whose step-cost curve the ranks profile
    together; ``oracle`` (the known continuation with planted wrong drafts) under ``fixed``, so that
    drafts are both accepted and rejected on the ranks."""
    folder, prompts, params, reference = spec_reference
    oracle = write_oracle_file(tmp_path, prompts, reference)
    spec = spec_plugins(drafter, plan, ngram_min=1, oracle_file=oracle, oracle_corruption=0.3)
    with LLM(folder, expert_parallel_size=2, max_num_seqs=8, plugins=spec, **ENGINE) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
        stats = llm.get_stats()
    assert stats["spec_decode"]["verify_steps"] > 0
    if drafter == "oracle":
        assert 1 < stats["spec_decode"]["mean_acceptance_length"] < 5
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_rank_stats_sum_counts_and_weight_spec_decode_means_by_verifies() -> None:
    """A rank that verified nothing does not drag the merged means down; counts add up."""
    busy = {"steps": 3, "num_running": 1, "spec_decode": {"mean_acceptance_length": 2.5, "verify_steps": 3,
                                                          "acceptance_per_position": [0.5, 0.25]}}
    idle = {"steps": 3, "num_running": 0, "spec_decode": {"mean_acceptance_length": 0.0, "verify_steps": 0,
                                                          "acceptance_per_position": [0.0, 0.0]}}
    merged = _sum_dicts([busy, idle])
    assert merged["steps"] == 6 and merged["num_running"] == 1
    assert merged["spec_decode"] == {"mean_acceptance_length": 2.5, "verify_steps": 3,
                                     "acceptance_per_position": [0.5, 0.25]}


def test_async_llm_refuses_to_run_as_one_of_several_torchrun_processes(monkeypatch: pytest.MonkeyPatch,
                                                                      tiny_v3_tok: Path) -> None:
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="torchrun started 2"):
        AsyncLLM(tiny_v3_tok, **ENGINE)


@pytest.mark.slow
def test_mtp_spec_decode_with_two_ranks_gives_the_single_process_greedy_ids(tmp_path: Path) -> None:
    from test_deepseek_v3 import _build as build_deepseek
    from test_deepseek_v3_mtp import _mtp_checkpoint

    _mtp_checkpoint(build_deepseek("v3-yarn", tmp_path), tmp_path)
    prompts = repeating_prompts(4, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(tmp_path, **ENGINE) as plain:
        reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = spec_plugins("mtp", "fixed", max_draft=3)
    with LLM(tmp_path, expert_parallel_size=2, max_num_seqs=8, plugins=spec, **ENGINE) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
        stats = llm.get_stats()
    assert stats["spec_decode"]["verify_steps"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
