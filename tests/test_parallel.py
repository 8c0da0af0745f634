"""Expert parallelism and DP attention over CPU rank processes (gloo): ``LLM(model,
expert_parallel_size=N)`` gives the single-process greedy tokens (logprobs within 1e-5, bitwise
under ``kernels.batch_invariant``), with and without expert rebalancing mid-run; ranks hold exactly
the weights their placement says; requests are spread by the router and come back in input order; a
bad request fails alone; ranks are torn down by ``shutdown()``, garbage collection and interpreter
exit."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tiny_deepseek import VOCAB, save_tiny_v3

from deepinfer import LLM, SamplingParams
from deepinfer.engine.intake import RequestIntake
from deepinfer.engine.request import Request

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_torch_thread")]

KV = 1 << 22
BLOCK = 16
MAX_NEW = 12
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = _prompts([5, 40, 17, 3, 29, 11, 23, 8], seed=7)


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory) -> Path:
    return save_tiny_v3(tmp_path_factory.mktemp("tiny-v3-ep"))


@pytest.fixture(scope="module")
def single(tiny_v3):
    """The single-process engine: reference tokens and reference expert weights."""
    llm = LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    return llm, tokens


@pytest.fixture(scope="module")
def ep2(tiny_v3):
    llm = LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK, expert_parallel_size=2)
    yield llm
    llm.shutdown()


def _tokens(llm, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _rank_pids(llm) -> list[int]:
    return [p.pid for p in llm.engine._group.procs]


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _check_layout(llm, single_llm) -> list[list[int]]:
    """Every rank agrees on the placement, and holds in each local slot exactly the weights of the
    logical expert the placement puts there; returns the placement rows."""
    ref = [m.mlp for m in single_llm.engine.model.layers if m.is_moe]
    layouts = llm.engine.expert_layout()
    rows = layouts[0]["placement"]
    for rank, layout in enumerate(layouts):
        assert layout["placement"] == rows
        for layer, (row, slots) in enumerate(zip(rows, layout["slots"], strict=True)):
            lo = rank * len(slots)
            assert [e for e, _, _ in slots] == row[lo:lo + len(slots)]
            for e, w13_sum, w2_sum in slots:
                assert w13_sum == float(ref[layer].w13.data[e].double().sum())
                assert w2_sum == float(ref[layer].w2.data[e].double().sum())
    return rows


def test_ep2_gives_the_single_process_tokens_in_input_order(single, ep2):
    _, ref = single
    outs = ep2.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = ep2.get_stats()
    assert stats["parallel"]["requests_per_rank"] == [4, 4]  # round_robin
    assert stats["generated_tokens"] == len(PROMPTS) * MAX_NEW  # summed over ranks
    assert stats["prompt_tokens"] == sum(map(len, PROMPTS))
    assert stats["parallel"]["dispatch_seconds_per_layer"] > 0
    assert "eplb" not in stats  # the plugin is not enabled


def _logprobs(llm, params: SamplingParams) -> list[tuple[list[int], list[dict[int, float]]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_ep2_logprobs_are_the_single_processs_and_bitwise_under_batch_invariance(single, ep2, tiny_v3):
    """The sampled rows' top logprobs of 2 ranks are within 1e-5 of one process's; with
    ``kernels.batch_invariant`` (fixed-chunk matmuls and attention splits, top-k summed in slot order)
    they are bitwise equal, although each rank sees other batches than the single process."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    ref, got = _logprobs(single[0], params), _logprobs(ep2, params)
    for (ids_r, lp_r), (ids_g, lp_g) in zip(ref, got, strict=True):
        assert ids_g == ids_r
        for row_r, row_g in zip(lp_r, lp_g, strict=True):
            assert row_g.keys() == row_r.keys()
            assert max(abs(row_g[t] - row_r[t]) for t in row_r) < 1e-5
    invariant = {"kv_cache_bytes": KV, "block_size": BLOCK, "kernels": {"batch_invariant": True}}
    one = LLM(tiny_v3, **invariant)
    two = LLM(tiny_v3, expert_parallel_size=2, **invariant)
    try:
        assert _logprobs(two, params) == _logprobs(one, params)
    finally:
        two.shutdown()
        one.shutdown()


def test_a_bad_request_fails_alone(single, ep2):
    _, ref = single
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ep2.generate([PROMPTS[0], [5, VOCAB + 1]], PARAMS, use_tqdm=False)
    engine = ep2.engine
    good = [engine.make_request(p, PARAMS) for p in PROMPTS[:3]]
    # A request that slipped past the driver's checks: its rank rejects it, the others run on.
    bad = Request("bad", None, [7, 10_000], PARAMS, 0, frozenset(), 64)
    doomed = engine.make_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for req in [*good, bad, doomed]:
        engine.add(req)
    assert engine.abort(doomed.request_id)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})
    assert done["bad"].outputs[0].finish_reason == "error"
    assert "vocabulary" in done["bad"].outputs[0].error
    assert done[doomed.request_id].outputs[0].finish_reason == "abort"
    assert [done[r.request_id].outputs[0].token_ids for r in good] == ref[:3]
    assert _tokens(ep2) == ref  # still serving


def test_the_driver_and_one_engine_validate_through_one_intake(single, ep2):
    """A bad request gets the same ``ValueError`` from the expert-parallel driver as from one engine:
    both check it with a ``RequestIntake`` (engine/intake.py) over the same model facts."""
    one, two = single[0].engine, ep2.engine
    assert type(one.intake) is type(two.intake) is RequestIntake
    assert (one.intake.vocab_size, one.intake.max_model_len) == (two.intake.vocab_size, two.intake.max_model_len)
    gen = torch.Generator().manual_seed(23)
    too_long = torch.randint(3, VOCAB, (one.max_model_len,), generator=gen).tolist()
    bad = [([], PARAMS), ([5, VOCAB + int(torch.randint(0, 50, (1,), generator=gen))], PARAMS),
           ([5, True], PARAMS), (too_long, PARAMS),
           ([5, 6], SamplingParams(max_tokens=4, stop_token_ids=[VOCAB + 3])),
           ([5, 6], SamplingParams(max_tokens=4, logit_bias={VOCAB: 1.0}))]
    for prompt, params in bad:
        errors = []
        for engine in (one, two):
            before = engine.intake.count
            with pytest.raises(ValueError) as caught:
                engine.make_request(prompt, params)
            assert engine.intake.count == before  # a refused request takes no number
            errors.append(str(caught.value))
        assert errors[0] == errors[1], (prompt, params)
    # Good requests are numbered and seeded by the same rule: the same count gives the same id and seed.
    offset = one.intake.count - two.intake.count
    if offset > 0:
        for _ in range(offset):
            two.make_request([5], PARAMS)
    else:
        for _ in range(-offset):
            one.make_request([5], PARAMS)
    a, b = one.make_request(PROMPTS[1], PARAMS), two.make_request(PROMPTS[1], PARAMS)
    assert (a.request_id, a.seed, a.max_total_tokens) == (b.request_id, b.seed, b.max_total_tokens)


def test_eplb_rebalancing_mid_run_keeps_tokens_and_weights_then_shutdown(single, tiny_v3):
    single_llm, ref = single
    eplb = {"enabled": True, "policy": "greedy_multistep", "interval": 4, "window": 4, "num_redundant_experts": 2}
    with LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK, expert_parallel_size=2, plugins={"eplb": eplb}) as llm:
        initial = _check_layout(llm, single_llm)
        assert initial[0] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]  # 8 logical + 2 redundant over 2 ranks
        assert _tokens(llm) == ref
        stats = llm.get_stats()["eplb"]
        assert stats["rebalances"] >= 3  # due at steps 1, 5, 9, … of a ~20-step run
        assert stats["policy"] == "greedy_multistep"
        assert 0 < stats["balancedness"] <= 1
        assert stats["last_predicted_balancedness_after"] >= stats["last_predicted_balancedness_before"] - 1e-9
        assert stats["placements_computed"] == stats["rebalances"]  # rank 0's plugin computed each one
        llm.engine.rebalance()  # forced, between generate calls
        moved = _check_layout(llm, single_llm)
        assert moved != initial
        assert _tokens(llm) == ref
        pids = _rank_pids(llm)
        assert all(_alive(p) for p in pids)
    # leaving the block called shutdown(): every rank is gone, and a second shutdown does nothing
    assert not any(_alive(p) for p in pids)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)


def test_four_ranks_least_loaded_router_third_party_policy_and_gc_teardown(single, tiny_v3, install_plugin):
    single_llm, ref = single
    install_plugin("deepinfer-rotate-placement", {"rotate": "deepinfer_rotate_placement"})
    plugins = {"eplb": {"enabled": True, "policy": "rotate"}, "rotate": {"enabled": True}}
    llm = LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK, expert_parallel_size=4, plugins=plugins,
              parallel={"router": "least_loaded"})
    assert _tokens(llm) == ref
    stats = llm.get_stats()
    # least_loaded: the 8 prompts (5, 40, 17, 3, 29, 11, 23, 8 tokens) go to the rank with the
    # fewest queued tokens at the time: ranks 0, 1, 2, 3, 3, 0, 0, 2
    assert stats["parallel"]["requests_per_rank"] == [3, 1, 2, 2]
    assert stats["eplb"]["policy"] == "rotate" and stats["eplb"]["rebalances"] == 1
    rows = _check_layout(llm, single_llm)
    assert rows[0] == [(p + 3) % 8 for p in range(8)]
    pids = _rank_pids(llm)
    del llm  # garbage collection tears the ranks down
    gc.collect()
    assert not any(_alive(p) for p in pids)


def test_interpreter_exit_ends_every_rank(single, tiny_v3, tmp_path):
    _, ref = single
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from deepinfer import LLM, SamplingParams
        llm = LLM({str(tiny_v3)!r}, kv_cache_bytes={KV}, block_size={BLOCK}, expert_parallel_size=2)
        outs = llm.generate({PROMPTS[:2]!r}, SamplingParams(temperature=0, max_tokens={MAX_NEW}, ignore_eos=True),
                            use_tqdm=False)
        print(json.dumps({{"pids": [p.pid for p in llm.engine._group.procs],
                           "tokens": [o.outputs[0].token_ids for o in outs]}}))
        # no shutdown(): the ranks must go when this interpreter exits
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_") or k == "DEEPINFER_CACHE_DIR"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == ref[:2]
    assert not any(_alive(p) for p in result["pids"])


def test_ranks_step_on_their_own_without_a_round_trip_per_step(single, ep2):
    """The driver sends requests and reads replies; the ranks step by themselves (``worker.serve``). Here
    the driver never asks for a step: the ranks run every request to the end (their step counters move,
    a collective ``get_stats`` reads them), and then one ``step()`` returns every finished output, with the
    single process's tokens."""
    engine = ep2.engine
    before = engine.get_stats()
    requests = [engine.make_request(p, PARAMS) for p in PROMPTS]
    for req in requests:
        engine.add(req)
    deadline = time.monotonic() + 120
    while (stats := engine.get_stats())["generated_tokens"] - before["generated_tokens"] < len(PROMPTS) * MAX_NEW:
        assert time.monotonic() < deadline, "the ranks did not run the requests by themselves"
        time.sleep(0.05)
    assert stats["steps"] - before["steps"] >= MAX_NEW
    outputs = {o.request_id: o for o in engine.step()}
    assert not engine.has_unfinished()
    assert [outputs[r.request_id].outputs[0].token_ids for r in requests] == single[1]


def test_shutdown_while_ranks_step_unread_ends_every_rank_cleanly(tiny_v3):
    """Requests left running while the driver reads nothing (the ranks go on stepping and replying):
    ``shutdown`` reaches every rank at the same point and each exits by itself (code 0, not killed)."""
    llm = LLM(tiny_v3, kv_cache_bytes=KV, block_size=BLOCK, expert_parallel_size=2)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for prompt in PROMPTS:
        engine.add(engine.make_request(prompt, params))
    time.sleep(4)  # the ranks step and reply; nobody reads
    procs = list(engine._group.procs)
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 15
    assert [proc.returncode for proc in procs] == [0, 0]
