"""Counter-based randomness and the sampler's distributions."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.sampling.rng import Purpose, splitmix64, splitmix64_int, uniform
from deepinfer.sampling.sampler import SamplingBatch, sample


def test_splitmix_matches_its_python_twin():
    gen = torch.Generator().manual_seed(3)
    xs = torch.randint(-(2**62), 2**62, (1000,), generator=gen, dtype=torch.int64)
    got = splitmix64(xs).tolist()
    want = [splitmix64_int(x & (2**64 - 1)) for x in xs.tolist()]
    assert [g & (2**64 - 1) for g in got] == want


def test_uniform_is_a_pure_function_of_seed_position_purpose():
    seeds = torch.tensor([5, 5, 6, 5])
    pos = torch.tensor([10, 10, 10, 11])
    u = uniform(seeds, pos, Purpose.SAMPLE)
    assert u[0] == u[1] and u[0] != u[2] and u[0] != u[3]
    assert uniform(seeds, pos, Purpose.ACCEPT)[0] != u[0]
    many = uniform(torch.full((100000,), 7), torch.arange(100000), Purpose.SAMPLE)
    assert many.min() >= 0 and many.max() < 1
    assert abs(many.mean().item() - 0.5) < 0.005


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The target distribution written independently of the sampler (float64, plain loops)."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    keep = set(order)
    if p.top_k > 0:
        keep &= set(order[: p.top_k])
    if p.top_p < 1:
        mass, kept = 0.0, set()
        for i in order:
            if mass >= p.top_p:
                break
            kept.add(i)
            mass += probs[i].item()
        keep &= kept
    if p.min_p > 0:
        keep &= {i for i in order if probs[i] >= p.min_p * probs[order[0]]}
    out = torch.zeros_like(probs)
    for i in keep:
        out[i] = probs[i]
    return out / out.sum()


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    n = counts.sum().item()
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token outside the allowed set was sampled"
    e = expected[mask] * n
    stat = ((counts[mask] - e) ** 2 / e).sum().item()
    df = int(mask.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.8, min_p=0.15),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.9, min_p=0.05),
], ids=["t1", "t0.6", "topk", "topp", "minp", "all"])
def test_sampled_distribution_matches_target(params):
    torch.manual_seed(11)
    logits = torch.randn(12) * 1.5
    n = 40000
    batch = SamplingBatch.build([params] * n, [1234] * n, list(range(n)), torch.device("cpu"))
    tokens = sample(logits.expand(n, -1).contiguous(), batch).tokens
    counts = torch.bincount(tokens, minlength=12).double()
    assert _chi_square_p(counts, _expected(logits, params)) > 1e-3


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * 5, [0] * 5, [0] * 5, torch.device("cpu"))
    assert torch.equal(sample(logits, batch).tokens, logits.argmax(-1))


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    _, folder = save_tiny("llama", tmp_path_factory.mktemp("sampling"))
    return LLM(folder, kv_cache_bytes=1 << 23, block_size=16)


def test_seeded_request_is_the_same_alone_and_in_a_batch(tiny_llm):
    target = [3, 14, 15, 92, 65]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=20, seed=2024, ignore_eos=True)
    alone = tiny_llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(2, 60, (8,), generator=gen)
    others = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in lengths]
    other_params = [SamplingParams(temperature=1.0, max_tokens=int(m), ignore_eos=True) for m in range(5, 40, 4)][:8]
    batch = [*others[:4], target, *others[4:]]
    outs = tiny_llm.generate(batch, [*other_params[:4], params, *other_params[4:]], use_tqdm=False)
    assert outs[4].outputs[0].token_ids == alone
    # a different seed gives a different continuation (20 tokens over a 256-token vocabulary)
    other_seed = SamplingParams(**{**params.__dict__, "seed": 7, "seq_seed": None})
    assert tiny_llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_seq_seed_is_an_alias_of_seed():
    assert SamplingParams(seq_seed=5).seed == 5
    with pytest.raises(ValueError, match="seq_seed"):
        SamplingParams(seed=1, seq_seed=2)


def test_logprobs_come_from_the_raw_distribution(tiny_llm):
    out = tiny_llm.generate([[1, 2, 3]], SamplingParams(temperature=0.5, max_tokens=4, logprobs=3, seed=1,
                                                          prompt_logprobs=2), use_tqdm=False)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for token, row in zip(out.outputs[0].token_ids, lps, strict=True):
        assert token in row and 3 <= len(row) <= 4
        assert all(v <= 0 for v in row.values())
        assert sum(math.exp(v) for v in row.values()) <= 1 + 1e-5
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 3
    assert out.prompt_logprobs[1][2] <= 0 and out.prompt_logprobs[2][3] <= 0
