"""Abort drills shared by the engine-level tests of the spec_decode and scheduling plugins: requests
aborted while others run, after which every KV block must be free again."""

from __future__ import annotations

import random
from collections.abc import Sequence

from deepinfer import LLM, SamplingParams
from deepinfer.engine.request import Request


def assert_preempted_then_aborts_free_every_block(llm: LLM, prompts: list[list[int]],
                                                  params: Sequence[SamplingParams]) -> None:
    """``llm`` has just run ``prompts`` with preemptions and given back every block; run them again and
    abort the 1st, 4th and 6th mid-flight (after the 4th step): every block comes back."""
    stats = llm.get_stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    engine = llm.engine
    requests = []
    for p, q in zip(prompts, params, strict=True):
        requests.append(engine.make_request(p, q))
        engine.add(requests[-1])
    for step in range(6):
        engine.step()
        if step == 3:
            for i in (0, 3, 5):
                assert engine.abort(requests[i].request_id)
    while engine.has_unfinished():
        engine.step()
    assert llm.get_stats()["kv_blocks_free"] == llm.get_stats()["kv_blocks_total"]


def drain_with_random_aborts(llm: LLM, requests: list[Request], rng: random.Random) -> dict[str, str]:
    """Add ``requests`` and step until none is left, aborting a random running one (its step may be in
    flight) after a step with probability 0.2. Checks every output (finished once, within ``max_tokens``,
    valid ids) and that every request finished; returns each request's finish reason."""
    engine = llm.engine
    for req in requests:
        engine.add(req)
    by_id = {r.request_id: r for r in requests}
    finished: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in finished
            finished[out.request_id] = out.outputs[0].finish_reason
            assert len(out.outputs[0].token_ids) <= by_id[out.request_id].params.max_tokens
            assert all(t >= 0 for t in out.outputs[0].token_ids)
        if rng.random() < 0.2:
            live = [r for r in requests if not r.finished and r.status.value == "running"]
            if live:
                assert engine.abort(rng.choice(live).request_id)
    assert set(finished) == set(by_id)
    return finished


def run_with_staged_aborts(llm: LLM, requests: list[Request], stride: int) -> None:
    """Add ``requests`` and run them to the end, aborting every ``stride``-th one after step 2 (from the
    1st) and after step 5 (from the 4th), while the others run; at least 3 must end aborted."""
    engine = llm.engine
    for req in requests:
        engine.add(req)
    for step in range(8):
        engine.step()
        if step in (2, 5):
            for req in requests[step - 2::stride]:
                engine.abort(req.request_id)
    while engine.has_unfinished():
        engine.step()
    assert sum(r.finish_reason == "abort" for r in requests) >= 3
