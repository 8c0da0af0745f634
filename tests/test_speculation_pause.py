"""The drafting pause of ``deepinfer/engine/speculation.py``: back-off, resumption on shared rounds, and follow-up
rows whose proposal is still on the device."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deepinfer.engine.scheduler import SchedulerOutput
from deepinfer.engine.speculation import EXPLORE_DRAFTS, PAUSE_LIMIT, Drafts, Speculator


def test_paused_requests_resume_drafting_on_shared_rounds():
    """Two requests whose drafts the plan never grants, the second starting 37 rounds later: each backs
    off 1, 2, 4 … rounds, and once both pause ``PAUSE_LIMIT`` rounds they probe on the same rounds, so a
    drafting step (whose cost is mostly per step) runs once for both instead of once for each."""
    speculator = Speculator(drafter=None, plan=None, cost=None, max_draft=4, block_size=16)
    starts = {"a": 0, "b": 37}
    drafted: dict[str, list[int]] = {rid: [] for rid in starts}
    rounds = 600
    for round_index in range(rounds):
        for rid, start in starts.items():
            if round_index >= start and not speculator.paused(rid):
                drafted[rid].append(round_index)
                speculator._note_grants([(rid, 4, 0)])  # offered 4 drafts, the plan granted none
        speculator.plan_drafting(SchedulerOutput(), [])  # a proposal round with nothing to draft
    late = {rid: [r for r in rounds_ if r >= 300] for rid, rounds_ in drafted.items()}
    assert late["a"] == late["b"] and late["a"] and all(r % PAUSE_LIMIT == 0 for r in late["a"])
    for rid, start in starts.items():
        gaps = [b - a for a, b in zip(drafted[rid], drafted[rid][1:], strict=False)]
        assert all(g <= min(2 ** (i + 1), PAUSE_LIMIT) + 1 for i, g in enumerate(gaps))  # back-off, capped
        assert len(drafted[rid]) <= 2 + (rounds - start).bit_length() + (rounds - start) // PAUSE_LIMIT



def test_a_new_request_starts_at_the_pause_its_predecessors_reached():
    """Requests one after another (batch 1) whose drafts the plan never grants: the first backs off
    1, 2, 4 … rounds; each later one starts at the pause the first reached (``plan_drafting`` calls
    ``_start_paused`` for each sampling row), so it does not pay a ramp of probes — each a drafting step —
    to learn it again. Once a round's plan grants a draft, new requests draft at once again."""
    speculator = Speculator(drafter=None, plan=None, cost=None, max_draft=4, block_size=16)
    drafted: dict[str, list[int]] = {}
    for rid in ("a", "b", "c"):
        drafted[rid] = []
        for round_index in range(200):
            speculator._start_paused(rid)
            if not speculator.paused(rid):
                drafted[rid].append(round_index)
                speculator._note_grants([(rid, 4, 0)])  # offered 4 drafts, the plan granted none
            speculator.plan_drafting(SchedulerOutput(), [])
        speculator.forget(rid)
    assert len(drafted["a"]) >= PAUSE_LIMIT.bit_length()  # the ramp: 1, 2, 4 … PAUSE_LIMIT
    for rid in ("b", "c"):
        gaps = [y - x for x, y in zip(drafted[rid], drafted[rid][1:], strict=False)]
        assert drafted[rid] and all(g == PAUSE_LIMIT for g in gaps), (rid, drafted[rid])
    speculator._note_grants([("d", 4, 2)])  # a round whose plan granted drafts
    speculator._start_paused("e")
    assert not speculator.paused("e")


class _NoDrafts:
    """A plan that never grants a draft (a batch where drafts do not pay)."""

    def budget(self, stale_confidence: torch.Tensor, cost: object) -> int:
        return stale_confidence.shape[0]

    def split(self, confidence: torch.Tensor, total: int) -> torch.Tensor:
        return torch.zeros(confidence.shape[0], dtype=torch.int64)


def test_a_follow_up_row_without_a_proposal_on_the_host_probes_and_keeps_its_pause():
    """Under an overlapped executor a request resuming after a pause has its first proposal on the device
    when its next row is planned: no confidence is known, so the plan's grant says nothing and must not
    double the pause (the request would otherwise never see its drafts judged); the row verifies a probe's
    draft. Once a proposal is on the host, a grant of none doubles the pause as before."""
    speculator = Speculator(drafter=None, plan=_NoDrafts(), cost=None, max_draft=4, block_size=16)
    req = SimpleNamespace(request_id="r", epoch=0, params=SimpleNamespace(max_tokens=100), num_output_tokens=10,
                          max_total_tokens=1000, num_tokens=50)
    speculator._pause["r"] = 4  # the pause just ended: it drafted after the step in flight
    speculator._drafted = {"r"}
    grants = speculator.plan_drafts([req], following={"r"})
    assert len(grants["r"].tokens) == EXPLORE_DRAFTS and grants["r"].on_device
    assert speculator._pause["r"] == 4 and not speculator.paused("r")
    speculator.proposals["r"] = Drafts(0, (5, 6, 7, 8), (0.3, 0.2, 0.1, 0.1), (0.3, 0.2, 0.1, 0.1))
    speculator.plan_drafts([req], following={"r"})  # the proposal it verifies is known now: judged
    assert speculator._pause["r"] == 8 and speculator.paused("r")
