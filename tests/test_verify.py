"""Lossless verification (``sampling/verify.py``) on synthetic logits: the emitted tokens follow the
target's distribution whatever the drafts, greedy verification is exact match with prefix
acceptance, and a request without drafts samples exactly as the plain sampler."""

from __future__ import annotations

import pytest
import torch
from test_sampling import _chi_square_p, _expected

from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.sampler import SamplingBatch, sample
from deepinfer.sampling.verify import VerifyBatch, verify

CPU = torch.device("cpu")


def _batch(params: list[SamplingParams], drafts: list[list[int]], base: list[int],
           probs: torch.Tensor | None = None, seeds: list[int] | None = None) -> VerifyBatch:
    seeds = seeds or [7] * len(params)
    k = max(len(d) for d in drafts)
    starts, row_request, row_offset = [], [], []
    for i, d in enumerate(drafts):
        starts.append(len(row_request))
        row_request += [i] * (1 + len(d))
        row_offset += list(range(1 + len(d)))
    t = torch.tensor
    return VerifyBatch(
        row_start=t(starts), drafts=t([d + [-1] * (k - len(d)) for d in drafts], dtype=torch.int64),
        num_drafts=t([len(d) for d in drafts]), draft_probs=probs,
        random_requests=t([i for i, p in enumerate(params) if not p.greedy], dtype=torch.int64),
        temperature=t([p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32),
        top_k=t([max(p.top_k, 0) for p in params]), top_p=t([p.top_p for p in params], dtype=torch.float32),
        min_p=t([p.min_p for p in params], dtype=torch.float32), seeds=t(seeds), base=t(base),
        sampling=SamplingBatch.build(params, seeds, base, CPU),
        row_request=t(row_request), row_offset=t(row_offset))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5),
                                    SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05)],
                         ids=["plain", "topk", "topp-minp"])
@pytest.mark.parametrize("draft_kind", ["onehot-likely", "onehot-unlikely", "smoothed"])
def test_emitted_tokens_follow_the_target(params, draft_kind):
    torch.manual_seed(3)
    vocab, n = 10, 30000
    row0, row1 = torch.randn(vocab) * 1.5, torch.randn(vocab) * 1.5
    q0 = _expected(row0, params)
    probs = None
    if draft_kind == "smoothed":  # drafts drawn from p (a different distribution than q)
        p = torch.softmax(torch.randn(vocab), dim=-1)
        drafts = torch.multinomial(p, n, replacement=True, generator=torch.Generator().manual_seed(5))
        probs = p.expand(n, 1, vocab).contiguous()
    else:
        d = int(q0.argmax()) if draft_kind == "onehot-likely" else int(q0.argmin())
        drafts = torch.full((n,), d)
    logits = torch.stack([row0, row1]).repeat(n, 1)
    batch = _batch([params] * n, [[int(x)] for x in drafts], list(range(0, 2 * n, 2)), probs,
                   seeds=list(range(n)))
    out = verify(logits, batch)
    first = out.tokens[:, 0]
    assert _chi_square_p(torch.bincount(first, minlength=vocab).double(), q0) > 1e-3
    accepted = out.num_accepted == 1
    assert (out.tokens[~accepted, 1] == -1).all()
    if q0[drafts].sum() == 0:  # the draft is outside the filtered support: never accepted
        assert not accepted.any()
        return
    second = out.tokens[accepted, 1]  # the bonus token after an accepted draft follows row 1
    assert _chi_square_p(torch.bincount(second, minlength=vocab).double(), _expected(row1, params)) > 1e-3


def test_greedy_verification_is_exact_match_with_prefix_acceptance():
    logits = torch.randn(7, 20)
    arg = logits.argmax(-1).tolist()
    greedy = SamplingParams(temperature=0)
    # request 0: rows 0-3, drafts = argmax of rows 0,1 then a wrong one; request 1: rows 4-6, first wrong
    wrong = (arg[2] + 1) % 20
    drafts = [[arg[0], arg[1], wrong], [(arg[4] + 3) % 20, arg[5]]]
    out = verify(logits, _batch([greedy, greedy], drafts, [10, 20]))
    assert out.num_accepted.tolist() == [2, 0]
    assert out.tokens.tolist() == [[arg[0], arg[1], arg[2], -1], [arg[4], -1, -1, -1]]


def test_a_request_without_drafts_samples_like_the_plain_sampler():
    torch.manual_seed(0)
    params = [SamplingParams(temperature=0.9, top_k=7, seed=3), SamplingParams(temperature=1.1, seed=4),
              SamplingParams(temperature=0)]
    logits = torch.randn(5, 30)
    batch = _batch(params, [[], [1, 2], []], [5, 9, 2], seeds=[3, 4, 5])
    out = verify(logits, batch)
    plain = sample(logits[[0, 4]], SamplingBatch.build([params[0], params[2]], [3, 5], [5, 2], CPU)).tokens
    assert out.tokens[[0, 2], 0].tolist() == plain.tolist()
    assert out.num_accepted[[0, 2]].tolist() == [0, 0]
