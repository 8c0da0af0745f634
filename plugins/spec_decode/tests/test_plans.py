"""Verification plans, calibration and the step-cost model on synthetic inputs."""

from __future__ import annotations

import itertools

import pytest
import torch
from deepinfer_spec_decode.calibration import IsotonicCalibrator
from deepinfer_spec_decode.plans import FixedPlan, VarlenPlan, acceptance_rates, take_best

from deepinfer.engine.cost import StepCost
from deepinfer.ops import pool_adjacent_violators


class CurveCost:
    """A step-cost model from a function of query tokens, plus ``per_request`` seconds of drafting."""

    def __init__(self, fn, per_request: float = 0.0):
        self.fn = fn
        self.per_request = per_request
        self.requests: set[int] = set()  # what the plan asked with

    def step_time(self, q: int, *, requests: int = 0) -> float:
        self.requests.add(requests)
        return self.fn(q) + self.per_request * requests

    def step_times(self, q: torch.Tensor, *, requests: int = 0) -> torch.Tensor:
        return torch.tensor([self.step_time(int(x), requests=requests) for x in q], dtype=torch.float64)

    def observe(self, q: int, seconds: float, **measured) -> None:
        pass


def _random_confidence(batch: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    conf = torch.rand(batch, k, generator=gen) * 0.9 + 0.1
    drafts = torch.randint(0, k + 1, (batch,), generator=gen)  # some requests have fewer drafts
    return torch.where(torch.arange(k) < drafts.unsqueeze(1), conf, torch.zeros(()))


def test_split_never_skips_a_draft_and_keeps_the_total():
    for seed in range(20):
        conf = _random_confidence(9, 5, seed)
        available = int((conf > 0).sum())
        for plan in (FixedPlan(), VarlenPlan()):
            for extra in range(0, available + 1):
                drafts = plan.split(conf, 9 + extra)
                assert int(drafts.sum()) == extra
                assert (drafts <= (conf > 0).sum(1)).all()
                if isinstance(plan, VarlenPlan):  # every taken slot is at least as likely as every skipped one
                    rates = acceptance_rates(conf)
                    taken = torch.arange(5) < drafts.unsqueeze(1)
                    valid = conf > 0
                    if taken.any() and (valid & ~taken).any():
                        assert rates[taken].min() >= rates[valid & ~taken].max()


def test_fixed_split_ranks_slots_by_position_then_request():
    """The fixed plan's split equals ``take_best`` over scores falling with the position (ties: the earlier
    request), for every total."""
    for seed in range(10):
        conf = _random_confidence(7, 4, seed)
        by_position = -torch.arange(4, dtype=torch.float64).expand_as(conf)
        for extra in range(int((conf > 0).sum()) + 2):
            want = take_best(by_position, conf > 0, extra)
            assert FixedPlan().split(conf, 7 + extra).tolist() == want.tolist()


def test_varlen_budget_maximizes_expected_tokens_per_second_over_all_budgets():
    curves = [lambda q: 1.0 + 0.05 * q, lambda q: 2.0 + 0.01 * q ** 1.5, lambda q: 0.5 + (0.3 if q > 12 else 0.0)]
    for seed, curve in itertools.product(range(10), curves):
        conf = _random_confidence(6, 4, seed)
        rates = torch.sort(acceptance_rates(conf).reshape(-1), descending=True).values
        rates = rates[rates > 0]
        best = max(range(len(rates) + 1), key=lambda m: ((6 + float(rates[:m].sum())) / curve(6 + m), -m))
        assert VarlenPlan().budget(conf, CurveCost(curve)) == 6 + best


def test_varlen_ties_are_deterministic_and_go_to_the_earlier_request():
    conf = torch.full((4, 3), 0.5)
    a = VarlenPlan().split(conf, 4 + 5)
    b = VarlenPlan().split(conf.clone(), 4 + 5)
    assert a.tolist() == b.tolist() == [2, 1, 1, 1]


def test_varlen_with_certain_drafts_and_a_flat_cost_equals_fixed():
    conf = _random_confidence(7, 5, 1)
    ones = torch.where(conf > 0, torch.ones(()), torch.zeros(()))
    flat = CurveCost(lambda q: 1.0)
    fixed, varlen = FixedPlan(), VarlenPlan()
    assert varlen.budget(ones, flat) == fixed.budget(ones, flat)
    total = fixed.budget(ones, flat)
    assert varlen.split(ones, total).tolist() == fixed.split(ones, total).tolist()


def test_pool_adjacent_violators_is_monotone_and_keeps_the_weighted_mean():
    values, weights = [0.5, 0.2, 0.9, 0.4, 0.8], [1.0, 3.0, 1.0, 1.0, 2.0]
    out = pool_adjacent_violators(values, weights)
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(out))
    before = sum(v * w for v, w in zip(values, weights, strict=True))
    assert abs(sum(o * w for o, w in zip(out, weights, strict=True)) - before) < 1e-9


def test_calibrator_learns_the_realized_acceptance_per_position():
    cal = IsotonicCalibrator(max_draft=2, bins=10)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3000):  # raw 0.95 everywhere; truly 30% at position 0, then 80% given position 0
        a0 = bool(torch.rand((), generator=gen) < 0.3)
        a1 = a0 and bool(torch.rand((), generator=gen) < 0.8)
        cal.observe([0.95, 0.95], 2, int(a0) + int(a1))
    out = cal.calibrate(torch.tensor([[0.95, 0.95]]))
    assert abs(out[0, 0] - 0.3) < 0.05 and abs(out[0, 1] - 0.8) < 0.06
    assert abs(float(cal.calibrate(torch.tensor([[0.15, 0.15]]))[0, 0]) - 0.15) < 0.2  # unseen bins pass through


def test_step_cost_profiles_once_interpolates_and_learns_a_slope():
    calls = []
    table = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, 16: 2.5, 24: 3.3}

    def measure(q):
        calls.append(q)
        return table[q]

    cost = StepCost(measure, 24, min_samples=3)
    assert abs(cost.step_time(3) - 1.2) < 1e-9 and calls == [1, 2, 4]  # only what the query needs
    assert abs(cost.step_time(12) - 2.1) < 1e-9
    assert abs(cost.step_time(32) - 4.1) < 1e-9 and calls == [1, 2, 4, 8, 16, 24]  # extended past the last two
    for _ in range(5):
        cost.observe(16, 2.5 + 16 * 0.01)  # every step 10 ms per token slower than profiled
    assert abs(cost.slope() - 0.01) < 1e-9 and abs(cost.step_time(16) - 2.66) < 1e-9
    assert len(calls) == 6


def _profiled(table):
    """``measure`` over a table of profiled seconds, and the sizes it was asked for."""
    calls = []

    def measure(q):
        calls.append(q)
        return table[q]

    return measure, calls


BUCKETS = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7, 16: 2.5, 24: 3.3}


def test_step_cost_fits_the_profiled_points_non_decreasing():
    """A cold first measurement (1 token slower than 4, as measured on CPU) is pooled with its
    neighbours: the curve never charges fewer tokens more."""
    measured = {1: 63.6, 2: 64.9, 4: 47.5, 8: 50.5}
    cost = StepCost(lambda q: measured[q], 8)
    cost.profile_all()
    curve = [cost.curve(q) for q in range(1, 9)]
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(curve))
    assert abs(curve[0] - sum(measured.values()) / 4) < 1e-9  # all four pooled: 56.6


def test_step_cost_under_graphs_charges_the_bucket_a_step_pads_to():
    measure, _ = _profiled(BUCKETS)
    graphs = StepCost(measure, 24, sizes=sorted(BUCKETS), bucketed=True, min_samples=3)
    eager = StepCost(measure, 24, sizes=sorted(BUCKETS))
    for q, bucket in [(1, 1), (3, 4), (4, 4), (9, 16), (15, 16), (17, 24), (24, 24)]:
        assert graphs.charged_tokens(q) == bucket and eager.charged_tokens(q) == q
        assert abs(graphs.step_time(q) - BUCKETS[bucket]) < 1e-9  # padding charged: a step function
    assert eager.step_time(9) < graphs.step_time(9)  # interpolation charges the real tokens only
    assert abs(graphs.step_time(32) - eager.step_time(32)) < 1e-9  # past the last graph: eager, extended
    for _ in range(3):  # a 9-token step replays the 16-token graph: its residual is per padded token
        graphs.observe(9, BUCKETS[16] + 16 * 0.01)
    assert abs(graphs.slope() - 0.01) < 1e-9 and abs(graphs.step_time(9) - (BUCKETS[16] + 0.16)) < 1e-9


def test_step_cost_reads_a_cost_every_step_pays_as_an_offset_not_per_token():
    """Real steps 8 ms slower than the profile at every size (longer contexts, host work): the
    correction is an offset, so verifying more tokens is not charged for it."""
    measure, _ = _profiled(BUCKETS)
    cost = StepCost(measure, 24, min_samples=3)
    for q in (1, 4, 8, 16, 24):
        for _ in range(3):
            cost.observe(q, cost.curve(q) + 0.008)
    assert abs(cost.offset() - 0.008) < 1e-9 and cost.slope() < 1e-9
    assert abs((cost.step_time(6) - cost.step_time(1)) - (cost.curve(6) - cost.curve(1))) < 1e-9


def test_step_times_equal_step_time_at_every_size():
    """The vectorized ``step_times`` (one call per varlen budget) charges what ``step_time`` does, with
    graphs and without, below, between and past the profiled sizes, after corrections and terms."""
    measure, _ = _profiled(BUCKETS)
    graphs = StepCost(measure, 24, sizes=sorted(BUCKETS), bucketed=True, min_samples=3)
    eager = StepCost(measure, 24, sizes=sorted(BUCKETS), min_samples=3)
    single = StepCost(lambda q: 0.5, 1, min_samples=3)
    sizes = torch.arange(1, 41)
    for cost in (graphs, eager, single):
        for q in (1, 4, 9, 16, 24):
            cost.observe(q, 0.3 + 0.02 * q, sampler_seconds=0.001 * q, requests=3, draft_seconds=0.012)
        for requests in (0, 5):
            expected = [cost.step_time(int(q), requests=requests) for q in sizes]
            assert torch.allclose(cost.step_times(sizes, requests=requests),
                                  torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_step_cost_needs_the_buckets_when_bucketed():
    with pytest.raises(ValueError, match="bucketed"):
        StepCost(lambda q: 1.0, 8, bucketed=True)


def test_step_cost_learns_the_sampler_per_verified_row_and_the_drafter_per_request():
    measure, _ = _profiled(BUCKETS)
    cost = StepCost(measure, 24, min_samples=5)
    gen = torch.Generator().manual_seed(3)
    for i in range(5):
        q = int(torch.randint(2, 25, (), generator=gen))
        assert cost.step_time(q, requests=2) == cost.curve(q)  # nothing learned yet: forward alone
        cost.observe(q, cost.curve(q), sampler_seconds=0.002 * q, requests=2 + i, draft_seconds=0.03 * (2 + i))
    cost.observe(8, cost.curve(8), sampler_seconds=5.0, requests=0, draft_seconds=9.0)  # no drafting: no sample
    assert abs(cost.sampler_per_row.value() - 0.002) < 1e-12
    assert cost.drafting.line() == pytest.approx((0.0, 0.03), abs=1e-12)
    assert abs(cost.step_time(10, requests=4) - (cost.curve(10) + 0.02 + 0.12)) < 1e-9
    assert abs(cost.step_time(10) - (cost.curve(10) + 0.02)) < 1e-9  # a plan that names no requests
    assert cost.slope() == 0.0  # the forward was as profiled


def test_drafting_cost_is_a_cost_per_step_plus_one_per_request():
    """Probes of one request cost 1.6 ms, full steps of 16 requests 12.1 ms (0.76 ms each): the model
    charges a step of 16 what it costs, not 16 probes; a negative intercept falls back to the origin."""
    from deepinfer.engine.cost import DraftingCost

    cost = DraftingCost(window=500, min_samples=5)
    assert cost.seconds(4) == 0.0  # nothing learned yet
    for i in range(30):
        cost.add(1, 0.0016 + 1e-6 * (i % 3))
        cost.add(16, 0.0121 + 1e-6 * (i % 5))
    per_step, per_request = cost.line()
    assert per_step == pytest.approx(0.0016 - 0.0105 / 15, abs=1e-6)
    assert per_request == pytest.approx(0.0105 / 15, abs=1e-7)
    assert cost.seconds(16) == pytest.approx(0.0121, abs=1e-5) and cost.seconds(0) == 0.0
    steep = DraftingCost(window=500, min_samples=1)
    for requests, seconds in ((1, 0.001), (2, 0.004)):  # intercept −0.002: through the origin instead
        steep.add(requests, seconds)
    assert steep.line()[0] == 0.0 and steep.line()[1] == pytest.approx(0.009 / 5)


def test_step_cost_reports_its_prediction_error():
    measure, _ = _profiled(BUCKETS)
    cost = StepCost(measure, 24, min_samples=1000)  # nothing is learned: every step is predicted by the curve
    assert cost.stats()["predicted_steps"] == 0 and cost.stats()["prediction_error"] == 0.0
    for q in (1, 3, 8, 20):  # 10% slower than predicted
        cost.observe(q, 1.1 * cost.curve(q))
    cost.observe(5, 0.9 * cost.curve(5) - 0.01, sampler_seconds=0.01)  # 10% faster, the sampler measured apart
    stats = cost.stats()
    assert stats["predicted_steps"] == 5
    assert abs(stats["prediction_error"] - 0.1 / 1.1) < 1e-9  # the median of four 1/11 and one 1/9
    assert set(stats) == {"prediction_error", "predicted_steps", "offset_seconds", "slope_seconds_per_token",
                          "sampler_seconds_per_row", "draft_seconds_per_step",
                          "draft_seconds_per_request", "host_seconds_drafting", "host_seconds_plain",
                          "curve_seconds"}
    assert stats["curve_seconds"] == {str(q): seconds for q, seconds in cost.points}


def test_step_cost_charges_the_hosts_own_time_by_kind_of_step():
    """A step's wall time past its measured parts is the host's own work: its median per kind of step (drafting
    or plain) is charged to the steps of that kind once both kinds were seen (before, neither: one kind's would
    stand for the baseline's too); a budget whose drafting steps cost the host 3 s more than plain ones (on a
    curve of 1–3 s) then grants no draft."""
    measure, _ = _profiled(BUCKETS)
    cost = StepCost(measure, 24, min_samples=3)
    assert cost.host_seconds(0) == cost.host_seconds(4) == 0.0
    for _ in range(3):  # drafting steps: 5 ms of forward, 1 of drafting, 20 of wall time
        cost.observe(6, 0.005, sampler_seconds=0.0, requests=1, draft_seconds=0.001, step_seconds=0.020)
    assert cost.host_seconds(1) == cost.host_seconds(0) == 0.0  # plain steps not seen yet
    assert cost.stats()["host_seconds_drafting"] == pytest.approx(0.014)
    assert cost.wants_plain_steps()  # the speculator makes plain rounds until it saw as many of them
    for _ in range(3):  # plain steps: 5 ms of forward, 7 of wall time
        cost.observe(1, 0.005, sampler_seconds=0.0, step_seconds=0.007)
    assert not cost.wants_plain_steps()
    assert cost.host_seconds(0) == pytest.approx(0.002) and cost.host_seconds(3) == pytest.approx(0.014)
    assert cost.step_time(6, requests=1) - cost.step_time(6) == pytest.approx(0.012 + cost.drafting.seconds(1))
    host_heavy = StepCost(measure, 24, min_samples=1)  # the curve's seconds exactly, then 3 s of host a drafting step
    host_heavy.observe(1, BUCKETS[1], sampler_seconds=0.0, step_seconds=BUCKETS[1])
    host_heavy.observe(2, BUCKETS[2], sampler_seconds=0.0, requests=1, draft_seconds=0.0, step_seconds=BUCKETS[2] + 3)
    sure = torch.full((1, 4), 0.9)
    assert VarlenPlan().budget(sure, StepCost(measure, 24)) > 1 and VarlenPlan().budget(sure, host_heavy) == 1


def test_varlen_charges_drafting_only_to_budgets_that_verify_drafts():
    """The baseline is decoding without speculation, which drafts nothing (the engine pauses drafting
    after a step that verifies no draft); every budget with drafts pays the drafting of every request
    that has drafts."""
    conf = _random_confidence(5, 4, 2)
    expensive_tokens = CurveCost(lambda q: 0.1 + 1.0 * q)
    drafting = int((conf > 0).any(dim=1).sum())
    assert VarlenPlan().budget(conf, expensive_tokens) == 5 and expensive_tokens.requests == {0, drafting}
    dear_drafting = CurveCost(lambda q: 1.0 + 0.001 * q, per_request=100.0)  # verified rows cheap, drafting dear
    assert VarlenPlan().budget(conf, dear_drafting) == 5
    cheap_drafting = CurveCost(lambda q: 1.0 + 0.001 * q, per_request=0.001)
    assert VarlenPlan().budget(conf, cheap_drafting) > 5


def test_varlen_weighs_drafts_against_the_whole_step():
    """Rows of zeros are decode requests without drafts: their tokens are in the step (a draft that pays
    beside one request does not beside 31 more on a per-token cost), and they draft nothing."""
    alone = torch.tensor([[0.6, 0.0]])
    crowded = torch.cat([alone, torch.zeros(31, 2)])
    cost = CurveCost(lambda q: 1.0 + 0.1 * q)
    assert VarlenPlan().budget(alone, cost) == 2  # 1.6 tokens in 1.2 s beat 1 in 1.1 s
    assert VarlenPlan().budget(crowded, cost) == 32  # 32.6 tokens in 4.3 s lose to 32 in 4.2 s
    assert cost.requests == {0, 1}  # drafting is charged for the one request with drafts


def test_unverified_positions_borrow_the_previous_positions_calibration():
    """A plan that never verifies deep drafts never observes them: they take the calibration of the
    position before, not the drafter's raw value."""
    cal = IsotonicCalibrator(max_draft=3, bins=10)
    for i in range(1000):  # only position 0 is ever verified; 30% of its 0.95-confidence drafts pass
        cal.observe([0.95, 0.95, 0.95], 1, int(i % 10 < 3))
    out = cal.calibrate(torch.tensor([[0.95, 0.95, 0.95]]))[0]
    assert all(abs(float(v) - 0.3) < 0.03 for v in out), out


def test_varlen_says_whether_drafting_pays_for_a_typical_request_at_a_batch_size():
    """``drafting_pays`` asks ``budget`` with every request offering the mean acceptance chances of the drafts
    ``budget`` was offered (16 requests of confidences 0.6, 0.5 here): on a cost where a verified row costs a
    tenth of a step and drafting little, drafts pay alone and not beside 31 other requests (the step's other rows
    dilute what a draft brings); dear drafting never pays; nothing offered yet (rows of zeros are requests
    without drafts): True (so the engine drafts and learns)."""
    cost = CurveCost(lambda q: 1.0 + 0.1 * q, per_request=0.001)

    def offered(plan: VarlenPlan, rows: torch.Tensor) -> VarlenPlan:
        plan.budget(rows, cost)
        return plan

    typical = torch.tensor([[0.6, 0.5]]).expand(16, 2)
    plan = offered(VarlenPlan(), typical)
    assert plan.drafting_pays(1, cost) and not plan.drafting_pays(32, cost)
    assert not plan.drafting_pays(1, CurveCost(lambda q: 1.0, per_request=10.0))
    assert offered(VarlenPlan(), torch.zeros(64, 2)).drafting_pays(32, cost) and VarlenPlan().drafting_pays(32, cost)


def test_drafting_must_promise_more_than_the_margin_to_pay():
    """A draft that promises 3.4% more tokens a second is taken by ``budget`` (the step's own choice) but does not
    open the gate, which asks for ``PAYS_MARGIN`` (5%) more: a gain under the cost model's error."""
    cost = CurveCost(lambda q: 1.0 + 0.45 * (q - 1))  # one verified draft of chance 0.5: 1.5 tokens in 1.45
    plan = VarlenPlan()
    plan.budget(torch.full((16, 1), 0.5), cost)  # 16 requests offer a draft of chance 0.5
    assert plan.budget(torch.tensor([[0.5]]), cost) == 2
    assert not plan.drafting_pays(1, cost)


def test_varlen_judges_drafting_by_every_offered_draft_not_by_the_verified_ones():
    """The typical request is the mean over the offered drafts: half the requests sure (0.95) and half not
    (0.05) is a typical chance of 0.5 at the first position, whatever varlen chose to verify; and the mean
    follows newer offers (``OFFERED_DECAY``): after many unsure steps drafting no longer pays where a step's
    verified row costs a third of it."""
    cost = CurveCost(lambda q: 1.0 + 0.3 * q)
    plan = VarlenPlan()
    mixed = torch.tensor([[0.95, 0.95]] * 8 + [[0.05, 0.05]] * 8)
    plan.budget(mixed, cost)
    assert plan._offered[0] / plan._offered_rows == pytest.approx(0.5)
    assert plan.drafting_pays(1, cost)
    for _ in range(400):
        plan.budget(torch.tensor([[0.05, 0.05]]), cost)
    assert not plan.drafting_pays(1, cost)


