"""The device-side fix-up of follow-up rows (``deepinfer/engine/followup.py``) against a host reference:
on random acceptance patterns, the fixed-up positions, cache slots, KV lengths, input ids, drafts, draft
counts, distributions and RNG counters equal those of rows laid out on the host after the previous step
was read."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from deepinfer.engine.context import SpanLayout, forward_context
from deepinfer.engine.drafting import StepTokens
from deepinfer.engine.followup import FollowUps
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.sampler import SamplingBatch
from deepinfer.sampling.verify import VerifyBatch

BLOCK = 4
K = 3
VOCAB = 50


@dataclass
class _Proposal:
    tokens: torch.Tensor
    probs: torch.Tensor | None


def _verify_batch(drafts: list[list[int]], num_drafts: list[int], counters: list[int],
                  sampling: SamplingBatch) -> VerifyBatch:
    n = len(drafts)
    rows = [1 + len(d) for d in drafts]
    starts = [sum(rows[:i]) for i in range(n)]

    def t(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    return VerifyBatch(
        row_start=t(starts), drafts=t([[*d] + [-1] * (K - len(d)) for d in drafts]), num_drafts=t(num_drafts),
        draft_probs=None, random_requests=t([0]), temperature=t([1.0] * n, torch.float32), top_k=t([0] * n),
        top_p=t([1.0] * n, torch.float32), min_p=t([0.0] * n, torch.float32), seeds=t([7] * n), base=t(counters),
        sampling=sampling, row_request=t([i for i, r in enumerate(rows) for _ in range(r)]),
        row_offset=t([j for r in rows for j in range(r)]))


@pytest.mark.parametrize("seed", range(6))
def test_follow_ups_equal_rows_laid_out_after_the_previous_step_was_read(seed):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (), generator=gen))  # noqa: E731
    # A plain row first (not a follow-up), then three follow-ups with 0..K draft rows each.
    starts = [5, *(rand(3, 20) for _ in range(3))]  # each row's start as laid out (no draft of N accepted)
    grants = [0, rand(0, K + 1), rand(0, K + 1), 0]  # the last follow-up's request did not draft: no draft row
    in_flight = [rand(0, K + 1) for _ in range(3)]  # draft rows of each follow-up's step in flight
    accepted = [rand(0, d + 1) for d in in_flight]
    rooms = [rand(0, K + 2) for _ in range(3)]
    tables = [list(range(10 * i + 1, 10 * i + 10)) for i in range(4)]
    sizes = [1 + g for g in grants]
    # The previous step: three sampling rows (the follow-ups' requests) and one more; its proposal has
    # rows for two of them.
    emitted = torch.full((4, K + 1), -1, dtype=torch.int64)
    for i, a in enumerate(accepted):
        emitted[i + 1, :a + 1] = torch.randint(0, VOCAB, (a + 1,), generator=gen)
    previous = StepTokens(emitted, torch.tensor([0, *accepted]))
    proposal_tokens = torch.randint(0, VOCAB, (2, K), generator=gen)
    proposal_tokens[1, rand(1, K):] = -1  # a shorter proposal
    probs = torch.softmax(torch.randn(2, K, VOCAB, generator=gen), dim=-1)
    proposal = _Proposal(proposal_tokens, probs)
    follow = FollowUps(token_rows=[sum(sizes[:i]) for i in (1, 2, 3)], requests=[1, 2, 3], samplers=[1, 2, 3],
                       random=[-1, 0, -1], sources=[1, 2, 3], proposal_rows=[0, 1, -1], drafts=grants[1:],
                       rooms=rooms)

    def layout(shift: list[int]) -> SpanLayout:
        return SpanLayout.of([(tables[i], starts[i] + shift[i], sizes[i]) for i in range(4)], BLOCK)

    nominal = layout([0, 0, 0, 0])
    ctx = forward_context(nominal, block_size=BLOCK, backends={}, device=torch.device("cpu"))
    input_ids = torch.zeros(len(nominal.positions), dtype=torch.int64)
    counters = [s + n for s, n in zip(starts, sizes, strict=True)]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0)]
    sampling = SamplingBatch.build(params, [7] * 4, [s - n + 1 for s, n in zip(counters, sizes, strict=True)],
                                   torch.device("cpu"))
    verify = _verify_batch([[]] + [[-1] * g for g in grants[1:]], grants, [s - n + 1 for s, n in
                                                                            zip(counters, sizes, strict=True)],
                           sampling)
    base_before, positions_before = verify.base.clone(), sampling.positions.clone()

    verify, moved = follow.apply(previous, proposal, input_ids, ctx, sampling, verify, 4, VOCAB)

    want = layout([0, *accepted])
    assert ctx.positions.tolist() == want.positions
    assert ctx.slot_mapping.tolist() == want.slots
    assert ctx.seq_lens.tolist() == want.seq_lens
    assert moved.tolist() == [0, *accepted]
    assert verify.base.tolist() == (base_before + torch.tensor([0, *accepted])).tolist()
    assert sampling.positions.tolist() == [positions_before[0] + accepted[1]]  # the one random row: follow-up 2
    for f in range(3):
        row, a, g = follow.token_rows[f], accepted[f], grants[f + 1]
        assert int(input_ids[row]) == int(emitted[f + 1, a])  # its last token: the previous step's final one
        drafts = proposal_tokens[f].tolist() if f < 2 else [-1] * K
        drafts = [d if j < g else -1 for j, d in enumerate(drafts)]
        usable = next((j for j, d in enumerate(drafts) if d < 0), K)
        assert int(verify.num_drafts[f + 1]) == min(usable, max(0, rooms[f] - a))
        assert verify.drafts[f + 1].tolist() == drafts
        assert input_ids[row + 1:row + 1 + g].tolist() == [max(d, 0) for d in drafts[:g]]
        if f < 2:
            assert verify.draft_probs is not None
            torch.testing.assert_close(verify.draft_probs[f + 1, :K], probs[f], rtol=0, atol=0)
    assert int(verify.num_drafts[0]) == 0 and int(input_ids[0]) == 0  # the plain row is untouched
