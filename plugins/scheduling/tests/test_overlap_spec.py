"""Speculative decoding under the overlapped executor gives the synchronous executor's outputs and
leaks nothing, with aborts and preemptions while a step is in flight.

Under speculation a request whose step is in flight runs in the next step too, as a follow-up row fixed
up on the device (plugins/scheduling/README.md); with the ``fixed`` plan it verifies the same drafts at
the same positions as under the synchronous executor: greedy tokens are identical for every plan,
seeded sampling for ``fixed``. ``varlen`` splits its budget over whichever requests share the step
(and its budget follows measured step times and, under overlap, stale confidences), so only its greedy
tokens are fixed by the model alone.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch
from abort_drills import drain_with_random_aborts
from spec_setup import repeating_prompts, spec_plugins, write_oracle_file
from test_deepseek_v3 import _build as build_deepseek
from test_deepseek_v3_mtp import _mtp_checkpoint
from test_deepseek_v4 import build as build_v4
from tiny_deepseek import save_tiny_v3
from tiny_models import save_tiny

from deepinfer import LLM, RequestOutput, SamplingParams

pytest.importorskip("deepinfer_spec_decode")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

OVERLAP = {"scheduling": {"enabled": True}}
MODELS = ["llama", "deepseek-v3", "deepseek-v4"]


def _kv_bytes(blocks: int, head_dim: int = 16) -> int:
    return blocks * 2 * 16 * 2 * head_dim * 4 * 2  # tiny Llama: K+V × block 16 × 2 kv heads × fp32 × 2 layers


def _llm(folder: Path, plugins: dict, **kw) -> LLM:
    kw.setdefault("kv_cache_bytes", 1 << 22)
    executor = "overlap" if "scheduling" in plugins else "sync"  # on a CPU device auto is sync
    return LLM(folder, block_size=16, max_num_seqs=8, plugins=plugins, scheduler={"executor": executor}, **kw)


def _run(folder: Path, plugins: dict, prompts, params, **kw) -> tuple[list[tuple[list[int], str]], LLM]:
    llm = _llm(folder, plugins, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], llm


def _staggered(llm: LLM, prompts, params) -> tuple[list[RequestOutput], int]:
    """Two requests arrive per step, so under overlap new requests run while others verify in flight.
    Returns the final outputs in request order and how many non-empty steps were scheduled while
    another step was in flight."""
    engine, core = llm.engine, llm.engine.core
    schedule, overlapped = core.schedule, [0]

    def spy():
        in_flight = bool(core.inflight)
        scheduled = schedule()
        overlapped[0] += in_flight and not scheduled.is_empty
        return scheduled

    core.schedule = spy
    requests = [engine.make_request(p, q) for p, q in zip(prompts, params, strict=True)]
    finished: dict[str, RequestOutput] = {}
    arriving = list(requests)
    while arriving or engine.has_unfinished():
        for req in arriving[:2]:
            engine.add(req)
        del arriving[:2]
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    core.schedule = schedule
    return [finished[r.request_id] for r in requests], overlapped[0]


def _run_staggered(folder: Path, plugins: dict, prompts, params, **kw) -> tuple[list[tuple[list[int], str]], LLM, int]:
    llm = _llm(folder, plugins, **kw)
    outs, overlapped = _staggered(llm, prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], llm, overlapped


def _assert_clean(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not llm.engine.core.inflight and not llm.engine.core.awaiting_release


@pytest.fixture(scope="module", params=MODELS)
def tiny_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek-v3":
        return save_tiny_v3(folder)
    if request.param == "deepseek-v4":
        build_v4("v4-yarn", folder)
        return folder
    return save_tiny(request.param, folder)[1]


@pytest.mark.parametrize("plan", ["fixed", "varlen"])
@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_overlap_equals_sync_with_speculation(tiny_dir, drafter, plan, tmp_path):
    prompts = repeating_prompts(8, 1, low=2)
    params = [SamplingParams(temperature=0.0 if plan == "varlen" or i % 2 else 0.9, top_p=0.95, seed=100 + i,
                             max_tokens=6 + 3 * i, ignore_eos=i % 3 == 0) for i in range(8)]
    extra = {}
    if drafter == "oracle":  # known continuations with planted errors: accepts, rejects and bonus tokens
        plain, _ = _run(tiny_dir, {}, prompts, params)
        extra = {"oracle_file": write_oracle_file(tmp_path, prompts, [o for o, _ in plain]), "oracle_corruption": 0.3,
                 "oracle_draft_probs": plan == "fixed"}
    spec = spec_plugins(drafter, plan, **extra)
    sync, sync_llm, _ = _run_staggered(tiny_dir, spec, prompts, params)
    overlap, llm, overlapped = _run_staggered(tiny_dir, {**spec, **OVERLAP}, prompts, params)
    assert type(llm.engine.executor).__name__ == "OverlapExecutor"
    assert overlap == sync
    assert overlapped > 0
    _assert_clean(llm)
    stats = llm.get_stats()
    assert stats["scheduling"]["device_steps"] > 0
    spec_stats, sync_stats = stats["spec_decode"], sync_llm.get_stats()["spec_decode"]
    if drafter == "oracle":
        assert spec_stats["verify_steps"] > 0
    if plan == "fixed":  # the same drafts verified at the same positions, so the same acceptance
        for key in ("verify_steps", "mean_acceptance_length", "acceptance_per_position"):
            assert spec_stats[key] == sync_stats[key], key


def test_mtp_drafts_under_overlap_keep_greedy_tokens(tmp_path):
    """The mtp drafter writes its cache rows for every committed token while the next step runs; with
    chunked prefills a request's next chunk is already scheduled when its previous one is processed."""
    folder = tmp_path / "v3-mtp"
    _mtp_checkpoint(build_deepseek("v3-yarn", folder), folder)
    prompts = repeating_prompts(6, 7, low=2)
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=i % 2 == 0) for i in range(6)]
    runs = {}
    for executor in ("sync", "overlap"):
        plugins = {**spec_plugins("mtp", "fixed", max_draft=3), **(OVERLAP if executor == "overlap" else {})}
        runs[executor], llm, overlapped = _run_staggered(folder, plugins, prompts, params, max_num_batched_tokens=24)
        assert llm.get_stats()["spec_decode"]["verify_steps"] > 0
        assert overlapped > 0 or executor == "sync"
        _assert_clean(llm)
    assert runs["overlap"] == runs["sync"]


def test_preemptions_and_aborts_in_flight_keep_greedy_tokens_and_leak_nothing(tmp_path):
    """A small cache preempts requests whose verification step is in flight; random aborts land while a
    step runs. Every request that is not aborted emits the synchronous executor's greedy tokens (an
    aborted one a prefix of them), and every block comes back."""
    folder = save_tiny("llama", tmp_path / "m")[1]
    prompts = repeating_prompts(40, 2, low=2)
    params = [SamplingParams(temperature=0, max_tokens=8 + i % 23, ignore_eos=True) for i in range(40)]
    reference, _ = _run(folder, {}, prompts, params, max_model_len=128)
    oracle = write_oracle_file(tmp_path, prompts, [o for o, _ in reference])
    spec = spec_plugins("oracle", "fixed", oracle_file=oracle, oracle_corruption=0.3)
    llm = _llm(folder, {**spec, **OVERLAP}, kv_cache_bytes=_kv_bytes(13), max_model_len=128)
    engine = llm.engine
    preempt, preempted_in_flight = engine.scheduler._preempt, [0]

    def spy(req):
        preempted_in_flight[0] += req.num_pending > 0  # its verification step has not been processed
        preempt(req)

    engine.scheduler._preempt = spy
    requests = [engine.make_request(p, q) for p, q in zip(prompts, params, strict=True)]
    arriving = list(requests)  # two per step: requests run in two cohorts, one of them always in flight
    rng = random.Random(5)
    finished = {}
    while arriving or engine.has_unfinished():
        for req in arriving[:2]:
            engine.add(req)
        del arriving[:2]
        for out in engine.step():
            assert out.request_id not in finished
            finished[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        if rng.random() < 0.1:
            live = [r for r in requests if not r.finished and r.num_pending]  # its step is in flight
            if live:
                assert engine.abort(rng.choice(live).request_id)
    reasons = [finished[r.request_id][1] for r in requests]
    assert "abort" in reasons and "length" in reasons
    for req, (tokens, _) in zip(requests, reference, strict=True):
        got, reason = finished[req.request_id]
        assert got == tokens if reason == "length" else tokens[:len(got)] == got
    assert preempted_in_flight[0] > 0 and llm.get_stats()["spec_decode"]["verify_steps"] > 0
    _assert_clean(llm)


def test_a_stress_run_with_aborts_leaks_nothing(tmp_path):
    """Many short sampled requests, a cache that preempts, aborts while steps are in flight."""
    folder = save_tiny("llama", tmp_path)[1]
    llm = _llm(folder, {**spec_plugins("ngram", "varlen"), **OVERLAP}, kv_cache_bytes=_kv_bytes(13), max_model_len=128)
    engine = llm.engine
    rng = random.Random(7)
    requests = [engine.make_request(p, SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randint(1, 16)))
                for i, p in enumerate(repeating_prompts(200, 3, low=2))]
    finished = drain_with_random_aborts(llm, requests, rng)
    assert {"abort", "length"} <= set(finished.values())
    assert llm.get_stats()["preemptions"] > 0
    _assert_clean(llm)


QUOTE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
         "All that glitters is not gold.")


def _smol_staggered(smollm2_dir: Path, plugins: dict, chats, params) -> tuple[list[RequestOutput], LLM, int]:
    llm = LLM(smollm2_dir, kv_cache_bytes=1 << 26, max_model_len=512, max_num_seqs=8, plugins=plugins,
              scheduler={"executor": "overlap" if "scheduling" in plugins else "sync"})
    prompts = [llm.engine.tokenizer.encode_chat(messages)[1] for messages in chats]
    outs, overlapped = _staggered(llm, prompts, params)
    return outs, llm, overlapped


def test_smollm2_ngram_greedy_overlap_equals_sync(smollm2_dir):
    chats = [[{"role": "user", "content": f"Repeat this text exactly, nothing else:\n{QUOTE}"}],
             [{"role": "user", "content": f"Copy the following sentences word for word:\n{QUOTE}"}],
             [{"role": "user", "content": "What is the capital of France?"}]]
    params = [SamplingParams(temperature=0, max_tokens=32)] * len(chats)
    tokens = {}
    for executor in ("sync", "overlap"):
        plugins = {**spec_plugins("ngram", "fixed"), **(OVERLAP if executor == "overlap" else {})}
        outs, llm, overlapped = _smol_staggered(smollm2_dir, plugins, chats, params)
        tokens[executor] = [o.outputs[0].token_ids for o in outs]
        assert llm.get_stats()["spec_decode"]["mean_acceptance_length"] > 1.5
        assert overlapped > 0 or executor == "sync"
        _assert_clean(llm)
        llm.shutdown()
    assert tokens["overlap"] == tokens["sync"]


def test_smollm2_structured_output_with_speculation_overlap_equals_sync(smollm2_dir):
    """Grammar masks of every verified position are filled by the host before the step samples."""
    pytest.importorskip("xgrammar")
    chats = [[{"role": "user", "content": "Reply with JSON only: a person with a name and an age."}],
             [{"role": "user", "content": "Pick a colour."}],
             [{"role": "user", "content": "Write a date."}],
             [{"role": "user", "content": "Reply with JSON only: a city and its population."}]]
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    city = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
            "required": ["city", "population"]}
    params = [SamplingParams(temperature=0, max_tokens=40, structured={"json_schema": person}),
              SamplingParams(temperature=0, max_tokens=8, structured={"choice": ["red", "green", "blue"]}),
              SamplingParams(temperature=0.8, seed=3, max_tokens=16, structured={"regex": r"20[0-9]{2}-[01][0-9]"}),
              SamplingParams(temperature=0.8, seed=4, max_tokens=40, structured={"json_schema": city})]
    results = {}
    for executor in ("sync", "overlap"):
        plugins = {**spec_plugins("ngram", "fixed"), **(OVERLAP if executor == "overlap" else {})}
        # Whether steps overlap here depends on how fast the grammars compile in the background (a request
        # waits for its matcher), so only the outputs are compared; the other tests assert the overlap.
        outs, llm, _ = _smol_staggered(smollm2_dir, plugins, chats, params)
        results[executor] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
        _assert_clean(llm)
        llm.shutdown()
    assert results["overlap"] == results["sync"]
    texts = [text for _, text, reason in results["overlap"] if reason == "stop"]
    assert len(texts) == 4
    assert set(json.loads(texts[0], strict=False)) >= {"name", "age"}
    assert texts[1] in ("red", "green", "blue") and texts[2][:2] == "20" and len(texts[2]) == 7
    assert set(json.loads(texts[3], strict=False)) >= {"city", "population"}


def _oracle_under_overlap(tmp_path, requests: int, max_tokens: int, corruption: float):
    """A tiny Llama under the overlapped executor with the ``oracle`` drafter (``corruption`` of its drafts
    wrong) and ``varlen``, ``requests`` repeating prompts, greedy params and the tokens without
    speculation (with their finish reasons)."""
    folder = save_tiny("llama", tmp_path / "m")[1]
    prompts = repeating_prompts(requests, 5)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain, _ = _run(folder, {}, prompts, params)
    spec = spec_plugins("oracle", "varlen", oracle_file=write_oracle_file(tmp_path, prompts, [o for o, _ in plain]),
                        oracle_corruption=corruption)
    return _llm(folder, {**spec, **OVERLAP}), prompts, params, plain


class _VerifyNothing:
    """A plan that never verifies a draft: every request's drafting pauses (1, 2, 4 … steps)."""

    def budget(self, stale_confidence, cost) -> int:
        return int(stale_confidence.shape[0])

    def split(self, confidence, total):
        return confidence.new_zeros(confidence.shape[0], dtype=torch.int64)


def test_a_request_whose_drafting_is_paused_runs_in_consecutive_steps_under_overlap(tmp_path):
    """While a request's drafting is paused there is no draft to wait for, so under overlap it is
    scheduled in consecutive steps, not every other one (step indices recorded), and the greedy tokens
    equal the synchronous executor's."""
    llm, prompts, params, plain = _oracle_under_overlap(tmp_path, 2, 64, 0.0)
    core = llm.engine.core
    llm.engine.speculator.plan = _VerifyNothing()
    schedule, steps_of, calls = core.schedule, {}, [0]

    def spy():  # every schedule call is a step index, empty ones (all requests waiting) included
        scheduled = schedule()
        for row in scheduled.batch.scheduled:
            steps_of.setdefault(row.request.request_id, []).append(calls[0])
        calls[0] += 1
        return scheduled

    core.schedule = spy
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == plain
    for steps in steps_of.values():
        consecutive = sum(b - a == 1 for a, b in itertools.pairwise(steps))
        assert consecutive >= 0.75 * (len(steps) - 1)
    _assert_clean(llm)


def test_a_speculating_request_verifies_drafts_in_consecutive_steps_under_overlap(tmp_path):
    """One request whose drafts are always right, under overlap with the ``fixed`` plan: it is scheduled in
    every step (step indices recorded), each of its decode steps after the first verifies drafts made on
    the device after the step before it (a follow-up row: that step was still in flight when this one was
    scheduled), and its greedy tokens equal decoding without speculation, in fewer steps."""
    llm, prompts, params, plain = _oracle_under_overlap(tmp_path, 1, 48, 0.0)
    llm.engine.speculator.plan = llm.engine.host.select("deepinfer_verification_plans", "fixed", "speculative.plan")
    core = llm.engine.core
    schedule, steps, calls = core.schedule, [], [0]

    def spy():
        scheduled = schedule()
        for row in scheduled.batch.scheduled:
            steps.append((calls[0], row.follows, row.draft_rows))
        calls[0] += 1
        return scheduled

    core.schedule = spy
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == plain
    indices = [i for i, _, _ in steps]
    assert indices == list(range(indices[0], indices[0] + len(indices)))  # never sits a step out
    decode = steps[2:]  # after the prefill and the first decode step (which follows the prefill's sampling)
    assert decode and all(follows for _, follows, _ in decode)
    assert sum(rows > 0 for _, _, rows in decode) >= len(decode) - 2  # all but the last, near max_tokens
    spec = llm.get_stats()["spec_decode"]
    assert spec["mean_acceptance_length"] > 3.5 and len(steps) < params.max_tokens / 3
    _assert_clean(llm)


class _EveryOtherCall:
    """A plan that verifies every draft on every other call and none on the others: requests keep
    entering and leaving their drafting pause while their steps are in flight."""

    def __init__(self) -> None:
        self.calls = 0

    def budget(self, stale_confidence, cost) -> int:
        self.calls += 1
        return int(stale_confidence.shape[0] + (stale_confidence > 0).sum()) if self.calls % 2 else \
            int(stale_confidence.shape[0])

    def split(self, confidence, total):
        extra = total - confidence.shape[0]
        return (confidence > 0).sum(dim=1) if extra else confidence.new_zeros(confidence.shape[0], dtype=torch.int64)


def test_pauses_that_start_and_end_under_overlap_never_draft_from_a_pending_token(tmp_path):
    """A request scheduled while its step is in flight (its drafting paused) must not draft before that
    step's tokens are known, nor verify a proposal made before it: the drafter never sees a pending
    token, and the greedy tokens equal the synchronous executor's, with every block back."""
    from deepinfer.engine.request import PENDING

    llm, prompts, params, plain = _oracle_under_overlap(tmp_path, 4, 40, 0.3)
    speculator = llm.engine.speculator
    speculator.plan = _EveryOtherCall()
    propose, seen = speculator.drafter.propose, []

    def checked(inputs):
        seen.append(bool((inputs.last_tokens == PENDING).any()))  # (the history's left padding is -1 too)
        return propose(inputs)

    speculator.drafter.propose = checked
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == plain
    assert seen and not any(seen)
    assert llm.get_stats()["spec_decode"]["verify_steps"] > 0
    _assert_clean(llm)


class _FirstRowOnly:
    """A plan that verifies the first request's drafts and never another's: the others pause while the
    first one's verification steps are in flight."""

    def budget(self, stale_confidence, cost) -> int:
        return int(stale_confidence.shape[0] + (stale_confidence[0] > 0).sum())

    def split(self, confidence, total):
        granted = confidence.new_zeros(confidence.shape[0], dtype=torch.int64)
        granted[0] = total - confidence.shape[0]
        return granted


def test_paused_requests_beside_a_verifying_one_keep_greedy_tokens_under_overlap(tmp_path):
    """Paused requests wait out a step in flight that verifies drafts (their pending input token could not
    be filled from it); the greedy tokens equal the synchronous executor's, with every block back."""
    llm, prompts, params, plain = _oracle_under_overlap(tmp_path, 4, 40, 0.3)
    llm.engine.speculator.plan = _FirstRowOnly()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == plain
    assert llm.get_stats()["spec_decode"]["verify_steps"] > 0
    _assert_clean(llm)
