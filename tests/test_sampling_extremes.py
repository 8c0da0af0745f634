"""Numerically safe sampling for every valid parameter value, and limits that agree offline and online.

Property: for random logits and extreme valid settings, the sampled token always has non-zero
probability under the intended distribution, computed here in float64 from the definitions
(temperature below 1e-5 is greedy; top-p keeps the smallest head whose mass reaches ``top_p``, and
at least the top token; min-p relative to the top token).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.sampling.params import GREEDY_BELOW, MAX_TEMPERATURE
from deepinfer.sampling.sampler import SamplingBatch, filtered_probs, sample

TEMPERATURES = [1e-300, 1e-38, 9.99e-6, GREEDY_BELOW, 1.3e-5, 1e-3, 1.0, MAX_TEMPERATURE]
TOP_PS = [1e-300, 1e-45, 1e-8, 0.3, 1.0]
TOP_KS = [-1, 1, 3]
MIN_PS = [0.0, 0.5, 1.0]


def _intended(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a request should draw from, ``[V]`` float64, from the definitions."""
    x = logits.double()
    if p.temperature < GREEDY_BELOW:
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).double()
    probs = torch.softmax(x / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    sorted_probs = probs[order]
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k:] = False
    keep &= (torch.cumsum(sorted_probs, 0) - sorted_probs) < p.top_p
    keep[0] = True
    kept = torch.zeros_like(probs)
    kept[order] = sorted_probs * keep
    return kept * (kept >= p.min_p * sorted_probs[0])


@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
def test_sampled_token_is_possible_under_extreme_parameters(scale):
    gen = torch.Generator().manual_seed(int(scale))
    vocab = 97
    combos = list(itertools.product(TEMPERATURES, TOP_PS, TOP_KS, MIN_PS))
    params = [SamplingParams(temperature=t, top_p=tp, top_k=k, min_p=mp, seed=i)
              for i, (t, tp, k, mp) in enumerate(combos)]
    logits = torch.randn(len(params), vocab, generator=gen) * scale
    logits[::5, :10] = float("-inf")  # masked tokens (a grammar's bitmask) never come back
    positions = torch.randint(0, 1000, (len(params),), generator=gen).tolist()
    batch = SamplingBatch.build(params, [p.seed for p in params], positions, torch.device("cpu"))
    tokens = sample(logits, batch).tokens.tolist()
    for row, (p, token) in enumerate(zip(params, tokens, strict=True)):
        intended = _intended(logits[row], p)
        assert intended[token] > 0, f"{p} sampled token {token} of probability 0"


def test_filtered_probs_is_a_distribution_for_extreme_parameters():
    gen = torch.Generator().manual_seed(11)
    n = len(TOP_PS)
    logits = torch.randn(n, 50, generator=gen) * 100
    out = filtered_probs(logits, torch.full((n,), GREEDY_BELOW), torch.zeros(n, dtype=torch.int64),
                         torch.tensor(TOP_PS, dtype=torch.float32), torch.zeros(n))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(n))
    assert (out.argmax(-1) == logits.argmax(-1)).all()


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=9.9e-6).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1e-9, 2.0001, 1e300])
def test_temperature_outside_the_server_range_is_refused_offline(value):
    with pytest.raises(ValueError, match=r"SamplingParams\.temperature must be a number in \[0, 2\]"):
        SamplingParams(temperature=value)


@pytest.mark.parametrize("value", [0.0, -0.5, math.nan, math.inf, 1.5])
def test_top_p_outside_its_range_is_refused(value):
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p"):
        SamplingParams(top_p=value)
