"""Logits processing (sampling/penalties.py): penalties, logit bias, allowed tokens, the early-EOS ban;
teacher forcing (golden_token_ids); uint64 seeds; and the SamplingParams checks of these fields."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.sampling.penalties import PenaltyRow, PenaltyState
from deepinfer.sampling.rng import Purpose, seed_lane, splitmix64_int, uniform

V = 40


def reference_adjust(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams,
                     output_index: int, banned: set[int]) -> list[float]:
    """The logits processing written independently of the module: plain Python per token."""
    out = list(logits)
    if p.allowed_token_ids is not None:
        out = [x if t in p.allowed_token_ids else -math.inf for t, x in enumerate(out)]
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    for t in range(len(out)):
        count = output.count(t)
        if t in prompt or count:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    if output_index < p.first_n_token_no_eos:
        for t in banned:
            out[t] = -math.inf
    return out


def _row(rid: str, p: SamplingParams, prompt: list[int], output: list[int], first_row: int = 0,
         drafts: tuple[int, ...] = (), epoch: int = 0, banned: frozenset[int] = frozenset({0})) -> PenaltyRow:
    return PenaltyRow(rid, epoch, p, prompt, output, first_row, len(output), drafts, banned)


PARAMS = [
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-1.2),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=0.3, presence_penalty=0.4),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(allowed_token_ids=[1, 2, 5, 9], logit_bias={2: 1.5, 11: 50.0}, frequency_penalty=0.5),
    SamplingParams(first_n_token_no_eos=100, presence_penalty=0.1),
]


def test_adjusted_logits_match_the_plain_reference():
    gen = torch.Generator().manual_seed(21)
    state = PenaltyState(V, torch.device("cpu"))
    rows, expected = [], []
    logits = torch.randn(len(PARAMS), V, generator=gen) * 3
    for i, p in enumerate(PARAMS):
        prompt = torch.randint(0, V, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        output = torch.randint(0, V, (int(torch.randint(0, 30, (1,), generator=gen)),), generator=gen).tolist()
        rows.append(_row(f"r{i}", p, prompt, output, first_row=i))
        expected.append(reference_adjust(logits[i].tolist(), prompt, output, p, len(output), {0}))
    step = state.plan(rows, 0)
    got = state.apply(step, logits)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-6, atol=1e-5)
    assert torch.equal(logits, logits.clone())  # the raw rows are left for logprobs


def test_a_request_without_processing_is_untouched_and_costs_nothing():
    state = PenaltyState(V, torch.device("cpu"))
    assert state.plan([_row("a", SamplingParams(), [1, 2], [3])], 0) is None
    logits = torch.randn(2, V)
    step = state.plan([_row("a", SamplingParams(), [1, 2], [3]),
                       _row("b", SamplingParams(frequency_penalty=1.0), [1], [4, 4], first_row=1)], 0)
    got = state.apply(step, logits)
    assert torch.equal(got[0], logits[0]) and got[1, 4] == logits[1, 4] - 2.0


def test_verified_rows_see_the_drafts_before_them():
    """Row j of a verifying request is penalized with the output plus drafts 1..j (lossless verification)."""
    gen = torch.Generator().manual_seed(4)
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3, first_n_token_no_eos=4)
    prompt, output, drafts = [1, 2, 3], [5, 6], (7, 5, 9)
    other = SamplingParams(presence_penalty=0.5)
    state = PenaltyState(V, torch.device("cpu"))
    rows = [_row("a", p, prompt, output, first_row=0, drafts=drafts),
            _row("b", other, [4], [8], first_row=1 + len(drafts), drafts=(8,))]
    logits = torch.randn(1 + len(drafts) + 2, V, generator=gen)
    got = state.apply(state.plan(rows, 3), logits)
    for j in range(1 + len(drafts)):
        want = reference_adjust(logits[j].tolist(), prompt, output + list(drafts[:j]), p, len(output) + j, {0})
        torch.testing.assert_close(got[j], torch.tensor(want), rtol=1e-6, atol=1e-5)
    for j in range(2):
        want = reference_adjust(logits[4 + j].tolist(), [4], [8] + [8] * j, other, 1 + j, {0})
        torch.testing.assert_close(got[4 + j], torch.tensor(want), rtol=1e-6, atol=1e-5)


def test_counts_follow_the_device_tokens_even_before_the_host_reads_them():
    """Step 2 is planned before step 1 ran (the overlapped executor): it still sees step 1's token,
    because ``record`` adds it on the device; a re-admitted request (new epoch) is rebuilt from the host."""
    p = SamplingParams(frequency_penalty=1.0)
    state = PenaltyState(V, torch.device("cpu"))
    step1 = state.plan([_row("a", p, [1], [2])], 0)
    step2 = state.plan([_row("a", p, [1], [2])], 0)  # host does not know step 1's token yet
    zeros = torch.zeros(1, V)
    state.apply(step1, zeros)
    state.record(step1, torch.tensor([9]))
    got = state.apply(step2, zeros)
    assert got[0, 2] == -1.0 and got[0, 9] == -1.0 and got[0, 3] == 0.0
    state.record(step2, torch.tensor([9]))
    # verified tokens: accepted drafts then the final token, -1 after
    step3 = state.plan([_row("a", p, [1], [2, 9, 9])], 0)
    state.apply(step3, zeros)
    state.record(step3, torch.tensor([[4, 4, 6, -1]]))
    step4 = state.plan([_row("a", p, [1], [2, 9, 9, 4, 4, 6])], 0)
    got = state.apply(step4, zeros)
    assert got[0, 4] == -2.0 and got[0, 9] == -2.0 and got[0, 6] == -1.0 and got[0, 0] == 0.0
    # preempted and re-admitted: rebuilt from the tokens the host knows (the device's count is dropped)
    step5 = state.plan([_row("a", p, [1], [2], epoch=1)], 0)
    got = state.apply(step5, zeros)
    assert got[0, 2] == -1.0 and got[0, 9] == 0.0 and got[0, 4] == 0.0


def test_released_slots_are_reused_and_rebuilt():
    state = PenaltyState(V, torch.device("cpu"))
    biased = SamplingParams(allowed_token_ids=[3])
    zeros = torch.zeros(1, V)
    step = state.plan([_row("a", biased, [1], [5, 5])], 0)
    state.apply(step, zeros)
    state.release("a")
    fresh = SamplingParams(frequency_penalty=1.0)
    got = state.apply(state.plan([_row("b", fresh, [1], [])], 0), zeros)
    assert state.num_slots == 1 and torch.equal(got, zeros)  # neither a's counts nor its mask remain
    for i in range(20):  # the tables grow past their first size
        state.plan([_row(f"c{i}", fresh, [1], [])], 0)
    got = state.apply(state.plan([_row("d", fresh, [1], [7])], 0), zeros)
    assert state.counts.shape[0] >= 22 and got[0, 7] == -1.0


# ------------------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0), ("repetition_penalty", float("inf")), ("logit_bias", {1: 101}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", [1, 2]), ("allowed_token_ids", []), ("allowed_token_ids", [1, -2]),
    ("first_n_token_no_eos", -1), ("first_n_token_no_eos", 1.5), ("eos_id", -1), ("golden_token_ids", [1, "a"]),
    ("seed", 2**64), ("seed", -(2**63) - 1),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**{field: value})


def test_seq_seed_takes_the_whole_uint64_range():
    assert SamplingParams(seq_seed=2**64 - 1).seed == 2**64 - 1
    assert seed_lane(2**64 - 1) == -1 and seed_lane(2**63) == -(2**63) and seed_lane(5) == 5


def _uniform_twin(seed: int, position: int, purpose: int) -> float:
    """``rng.uniform`` on Python ints (unsigned 64-bit arithmetic throughout)."""
    key = splitmix64_int((splitmix64_int(seed % 2**64) + 4 * position + purpose) % 2**64)
    return (key >> 11) / 2**53


def test_uniform_of_seeds_above_2_63_matches_unsigned_arithmetic():
    seeds = [2**63, 2**63 + 12345, 2**64 - 1, 0xDEADBEEFCAFEF00D, 7]
    positions = [0, 3, 17, 2**20, 99]
    got = uniform(torch.tensor([seed_lane(s) for s in seeds]), torch.tensor(positions), Purpose.ACCEPT)
    want = [_uniform_twin(s, p, int(Purpose.ACCEPT)) for s, p in zip(seeds, positions, strict=True)]
    assert got.tolist() == want


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    _, folder = save_tiny("llama", tmp_path_factory.mktemp("penalties"))
    llm = LLM(folder, kv_cache_bytes=1 << 23, block_size=16)
    yield llm
    llm.shutdown()


def _ids(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_uint64_seed_samples_like_its_int64_twin(tiny_llm):
    base = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    high = _ids(tiny_llm, [[4, 5, 6]], SamplingParams(**base, seq_seed=2**64 - 3))
    assert high == _ids(tiny_llm, [[4, 5, 6]], SamplingParams(**base, seed=-3))
    assert high != _ids(tiny_llm, [[4, 5, 6]], SamplingParams(**base, seed=3))


def test_token_ids_outside_the_vocabulary_are_refused_before_queueing(tiny_llm):
    for field, value in [("logit_bias", {256: 1.0}), ("allowed_token_ids", [3, 999]), ("golden_token_ids", [256]),
                         ("eos_id", 300)]:
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} has \d+, outside the vocabulary"):
            tiny_llm.generate([[1, 2]], SamplingParams(**{field: value}), use_tqdm=False)


def test_greedy_frequency_and_presence_penalties_follow_the_raw_logits(tiny_llm):
    """Each penalized greedy token is the argmax of the raw distribution (prompt logprobs of the whole
    sequence, all 256 tokens) minus the penalties of the tokens before it."""
    prompt = [7, 8, 9, 10]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5)
    out = _ids(tiny_llm, [prompt], p)[0]
    assert out != _ids(tiny_llm, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    scored = tiny_llm.generate([prompt + out], SamplingParams(max_tokens=1, prompt_logprobs=256), use_tqdm=False)
    rows = scored[0].prompt_logprobs
    for m, token in enumerate(out):
        logp = rows[len(prompt) + m]
        adjusted = {t: lp - 1.5 * out[:m].count(t) - 0.5 * (t in out[:m]) for t, lp in logp.items()}
        best = max(adjusted.values())
        assert adjusted[token] >= best - 1e-4, f"token {m}"


def test_penalized_tokens_are_batch_invariant_and_executor_invariant(tiny_llm, tmp_path):
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (3, 17, 9, 30, 5)]
    params = [SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=i, frequency_penalty=0.8,
                             repetition_penalty=1.3, logit_bias={5: 3.0}) for i in range(4)]
    params.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=1.0,
                                 allowed_token_ids=list(range(0, 256, 3))))
    together = _ids(tiny_llm, prompts, params)
    alone = [_ids(tiny_llm, [pr], pa)[0] for pr, pa in zip(prompts, params, strict=True)]
    assert together == alone
    assert all(t % 3 == 0 for t in together[4])
    _, folder = save_tiny("llama", tmp_path / "m")
    overlap = LLM(folder, kv_cache_bytes=1 << 23, block_size=16, plugins={"scheduling": {"enabled": True}},
                  scheduler={"executor": "overlap"})
    assert type(overlap.engine.executor).__name__ == "OverlapExecutor"
    assert _ids(overlap, prompts, params) == together
    overlap.shutdown()


def test_first_n_token_no_eos_bans_eos_then_lets_it_stop(tiny_llm):
    eos = min(tiny_llm.engine.eos_token_ids)
    forced_eos = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    assert _ids(tiny_llm, [[3, 4]], forced_eos)[0] == [eos]
    banned = dataclasses.replace(forced_eos, first_n_token_no_eos=3)
    out = _ids(tiny_llm, [[3, 4]], banned)[0]
    assert len(out) == 4 and eos not in out[:3] and out[3] == eos
    # eos_id names the banned token (the reference's HACK field); the model's EOS still stops
    other = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={11: 100.0},
                           first_n_token_no_eos=2, eos_id=11)
    out = _ids(tiny_llm, [[3, 4]], other)[0]
    assert 11 not in out[:2] and out[2:] == [11] * 4


def test_golden_tokens_are_forced_and_scored_by_the_model(tiny_llm):
    prompt, golden = [20, 21, 22], [9, 200, 9, 31]
    p = SamplingParams(temperature=0.7, max_tokens=7, ignore_eos=True, seed=3, logprobs=0, golden_token_ids=golden)
    out = tiny_llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:4] == golden and len(out.token_ids) == 7
    free = tiny_llm.generate([prompt + golden], dataclasses.replace(p, golden_token_ids=None, max_tokens=3),
                             use_tqdm=False)[0].outputs[0]
    assert out.token_ids[4:] == free.token_ids  # after the golden tokens, sampling goes on from the same state
    scored = tiny_llm.generate([prompt + golden], SamplingParams(max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0].prompt_logprobs
    for m, token in enumerate(golden):
        assert out.logprobs[m][token] == pytest.approx(scored[len(prompt) + m][token], abs=1e-5)
