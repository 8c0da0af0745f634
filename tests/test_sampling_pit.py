"""Randomized PIT + Kolmogorov–Smirnov tests of sampled tokens against their target distributions.

The probability integral transform of a discrete draw ``x ~ q``, randomized within its own step
(``u = Q(x−1) + v·q(x)`` with ``v ~ U(0, 1)`` independent and ``Q`` the CDF in token order), is exactly
uniform on [0, 1). So every draw may come from a *different* distribution — fresh logits, a different
temperature, top-k, top-p, min-p, penalties — and the transformed draws are still one uniform sample,
which one KS test checks. This complements the chi-square tests (tests/test_sampling.py,
tests/test_verify.py), which need many draws from one distribution. The targets here are written
independently of the sampler (``_expected``, ``reference_adjust``: plain Python per token).

The default variants draw 2,000 tokens over 24 (seconds on two cores); the ``slow`` ones 20,000 over 64
(minutes: the independent targets are Python loops). The KS threshold is p > 1e-3 (with fixed seeds, one
run is deterministic).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_penalties import _row, reference_adjust
from test_sampling import _expected
from test_verify import _batch

from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.penalties import PenaltyState
from deepinfer.sampling.sampler import SamplingBatch, sample
from deepinfer.sampling.verify import verify

CPU = torch.device("cpu")
SIZES = [pytest.param((2000, 24), id="quick"), pytest.param((20000, 64), id="long", marks=pytest.mark.slow)]


def ks_uniform_p_value(u: torch.Tensor) -> float:
    """p-value of the one-sample KS test of ``u`` against U(0, 1): the Kolmogorov distribution's tail
    ``2 Σ (−1)^(j−1) exp(−2 j² λ²)`` at ``λ = (√n + 0.12 + 0.11/√n) · D`` (Stephens' small-n correction)."""
    n = u.numel()
    x = torch.sort(u.double()).values
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = max((i / n - x).max().item(), (x - (i - 1) / n).max().item())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    if lam < 0.2:
        return 1.0
    p = 2 * sum((-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 101))
    return min(max(p, 0.0), 1.0)


def randomized_pit(q: torch.Tensor, tokens: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``u = Q(x − 1) + v · q(x)`` per row of ``q [N, V]`` (each row a distribution) and draw ``tokens [N]``.

    ``Q`` runs over the tokens in descending target probability (any fixed order keeps ``u`` uniform;
    this one gives the test power against a wrong temperature, top-p or penalty, which move mass
    between likely and unlikely tokens)."""
    q = q.double()
    qx = q.gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert (qx > 0).all(), "a token outside the target's support was drawn"
    ranked, order = torch.sort(q, dim=1, descending=True, stable=True)
    rank = torch.argsort(order, dim=1).gather(1, tokens.unsqueeze(1))
    before = torch.cumsum(ranked, dim=1).gather(1, rank).squeeze(1) - qx
    return before + torch.rand(tokens.numel(), generator=gen, dtype=torch.float64) * qx


def _random_params(n: int, gen: torch.Generator) -> list[SamplingParams]:
    """A different setting per row: temperature, top-k, top-p and min-p, alone and combined."""
    out = []
    for i in range(n):
        r = torch.rand(4, generator=gen).tolist()
        kind = i % 5
        out.append(SamplingParams(
            temperature=0.3 + 1.5 * r[0],
            top_k=int(2 + 10 * r[1]) if kind in (1, 4) else -1,
            top_p=0.3 + 0.7 * r[2] if kind in (2, 4) else 1.0,
            min_p=0.3 * r[3] if kind in (3, 4) else 0.0))
    return out


def test_ks_has_power_against_a_wrong_temperature():
    """The method detects a small mismatch: draws at temperature 1.15 tested against temperature 1."""
    gen = torch.Generator().manual_seed(1)
    n, v = 6000, 24
    logits = torch.randn(n, v, generator=gen) * 2
    drawn = torch.multinomial(torch.softmax(logits / 1.15, dim=-1), 1, generator=gen).squeeze(1)
    assert ks_uniform_p_value(randomized_pit(torch.softmax(logits.double(), dim=-1), drawn, gen)) < 1e-3
    right = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(1)
    assert ks_uniform_p_value(randomized_pit(torch.softmax(logits.double(), dim=-1), right, gen)) > 1e-3


@pytest.mark.parametrize("size", SIZES)
def test_sampler_draws_follow_their_targets(size):
    n, v = size
    gen = torch.Generator().manual_seed(17)
    logits = torch.randn(n, v, generator=gen) * 2
    params = _random_params(n, gen)
    batch = SamplingBatch.build(params, list(range(n)), [int(x) for x in torch.randint(0, 10**6, (n,), generator=gen)],
                                CPU)
    tokens = sample(logits, batch).tokens
    q = torch.stack([_expected(logits[i], p) for i, p in enumerate(params)])
    assert ks_uniform_p_value(randomized_pit(q, tokens, gen)) > 1e-3


def _penalized(n: int, v: int, gen: torch.Generator):
    """Rows with their own prompt, output so far and penalties; the logits as the sampler sees them and
    the independent target (``reference_adjust`` then temperature)."""
    rows, params, targets = [], [], []
    logits = torch.randn(n, v, generator=gen) * 2
    for i in range(n):
        r = torch.rand(6, generator=gen).tolist()
        p = SamplingParams(temperature=0.5 + r[0], frequency_penalty=4 * r[1] - 2, presence_penalty=4 * r[2] - 2,
                           repetition_penalty=0.5 + 1.5 * r[3],
                           logit_bias={min(int(v * r[4]), v - 1): 10 * r[5] - 5} if i % 3 == 0 else None)
        prompt = torch.randint(0, v, (1 + i % 7,), generator=gen).tolist()
        output = torch.randint(0, v // 2, (i % 23,), generator=gen).tolist()
        rows.append(_row(f"r{i}", p, prompt, output, first_row=i))
        params.append(p)
        adjusted = torch.tensor(reference_adjust(logits[i].tolist(), prompt, output, p, len(output), set()))
        targets.append(torch.softmax(adjusted.double() / p.temperature, dim=-1))
    return logits, rows, params, torch.stack(targets)


@pytest.mark.parametrize("size", SIZES)
def test_penalized_draws_follow_the_penalized_target(size):
    n, v = size
    gen = torch.Generator().manual_seed(29)
    logits, rows, params, q = _penalized(n, v, gen)
    state = PenaltyState(v, CPU)
    adjusted = state.apply(state.plan(rows, 0), logits)
    tokens = sample(adjusted, SamplingBatch.build(params, list(range(n)), [5] * n, CPU)).tokens
    assert ks_uniform_p_value(randomized_pit(q, tokens, gen)) > 1e-3


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("draft_kind", ["smoothed", "onehot"])
def test_verified_tokens_follow_the_target_with_accepted_and_rejected_drafts(size, draft_kind):
    """One draft per request, each request with its own two target rows and settings: the first emitted
    token (an accepted draft or a residual draw) follows row 0's target, the token after an accepted
    draft follows row 1's. Both outcomes must occur often."""
    n, v = size
    gen = torch.Generator().manual_seed(41)
    params = _random_params(n, gen)
    logits = torch.randn(2 * n, v, generator=gen) * 2
    q0 = torch.stack([_expected(logits[2 * i], p) for i, p in enumerate(params)])
    q1 = torch.stack([_expected(logits[2 * i + 1], p) for i, p in enumerate(params)])
    probs = None
    if draft_kind == "smoothed":  # drafts from a different distribution p (half q0, half noise), reported
        p = 0.5 * q0.float() + 0.5 * torch.softmax(torch.randn(n, v, generator=gen) * 1.5, dim=-1)
        drafts = torch.multinomial(p, 1, generator=gen).squeeze(1)
        probs = p.unsqueeze(1)
    else:  # one-hot drafts: a likely token half the time, an arbitrary one otherwise
        likely = q0.argmax(dim=1)
        drafts = torch.where(torch.rand(n, generator=gen) < 0.5, likely, torch.randint(0, v, (n,), generator=gen))
    batch = _batch(params, [[int(d)] for d in drafts], list(range(0, 2 * n, 2)), probs, seeds=list(range(n)))
    out = verify(logits, batch)
    accepted = out.num_accepted == 1
    assert 0.1 < accepted.double().mean().item() < 0.9
    assert ks_uniform_p_value(randomized_pit(q0, out.tokens[:, 0], gen)) > 1e-3
    assert ks_uniform_p_value(randomized_pit(q1[accepted], out.tokens[accepted, 1], gen)) > 1e-3


def test_verified_tokens_follow_the_penalized_target():
    """Penalties at verification: row 1 of a request is penalized with its draft counted, so the bonus
    token after an accepted draft follows the target the sampler would have used after that draft."""
    gen = torch.Generator().manual_seed(43)
    n, v = 2000, 24
    params = []
    rows, q0, q1 = [], [], []
    logits = torch.randn(2 * n, v, generator=gen) * 2
    p_draft = torch.softmax(torch.randn(n, v, generator=gen), dim=-1)
    drafts = torch.multinomial(p_draft, 1, generator=gen).squeeze(1)
    for i in range(n):
        r = torch.rand(4, generator=gen).tolist()
        p = SamplingParams(temperature=0.6 + r[0], frequency_penalty=2 * r[1], presence_penalty=2 * r[2] - 1,
                           repetition_penalty=0.7 + r[3])
        prompt, output = [i % v], torch.randint(0, v, (i % 9,), generator=gen).tolist()
        d = int(drafts[i])
        rows.append(_row(f"r{i}", p, prompt, output, first_row=2 * i, drafts=(d,)))
        params.append(p)
        for target, logit_row, seen in ((q0, logits[2 * i], output), (q1, logits[2 * i + 1], [*output, d])):
            adjusted = torch.tensor(reference_adjust(logit_row.tolist(), prompt, seen, p, len(seen), set()))
            target.append(torch.softmax(adjusted.double() / p.temperature, dim=-1))
    state = PenaltyState(v, CPU)
    adjusted = state.apply(state.plan(rows, 1), logits)
    out = verify(adjusted, _batch(params, [[int(d)] for d in drafts], [0] * n, p_draft.unsqueeze(1),
                                  seeds=list(range(n))))
    accepted = out.num_accepted == 1
    assert 0.1 < accepted.double().mean().item() < 0.9
    assert ks_uniform_p_value(randomized_pit(torch.stack(q0), out.tokens[:, 0], gen)) > 1e-3
    assert ks_uniform_p_value(randomized_pit(torch.stack(q1)[accepted], out.tokens[accepted, 1], gen)) > 1e-3
