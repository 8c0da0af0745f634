"""Drivers of the batch-invariance tests (``tests/test_batch_invariant.py``, the attention plugin's
``test_batch_invariant_triton.py``): one target request generated alone and among neighbours, whose
tokens and logprobs must be bitwise the same in every composition."""

from __future__ import annotations

import torch

from deepinfer import LLM, SamplingParams

LOGPROBS = 5


def neighbour_ids(seed: int, length: int, vocab: int) -> list[int]:
    """A fresh random prompt of ``length`` ids in ``[3, vocab)``, fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def generate_among(llm: LLM, target: list[int], params: SamplingParams, neighbours: list[list[int]], *,
                   neighbour_tokens: int, target_index: int = 0,
                   delay_steps: int = 0) -> tuple[list[int], list[dict[int, float]]]:
    """Generate ``target`` among ``neighbours`` (greedy, ``neighbour_tokens`` tokens each); the target is
    queued at ``target_index``, or with ``delay_steps`` joins only after the neighbours ran that many
    steps, so its prefill meets their decodes. Returns the target's tokens and logprobs."""
    engine = llm.engine
    others = [engine.make_request(ids, SamplingParams(temperature=0, max_tokens=neighbour_tokens, ignore_eos=True))
              for ids in neighbours]
    mine = engine.make_request(target, params)
    queue = others[:target_index] + ([mine] if not delay_steps else []) + others[target_index:]
    for req in queue:
        engine.add(req)
    for _ in range(delay_steps):
        engine.step()
    if delay_steps:
        engine.add(mine)
    done = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == mine.request_id and out.finished:
                done = out
    assert done is not None
    return done.outputs[0].token_ids, done.outputs[0].logprobs


def check_invariance(llm: LLM, vocab: int, prompt_len: int, compositions: list[tuple[list[int], int, int]],
                     target_tokens: int) -> None:
    """A ``prompt_len``-token target's greedy tokens and top-``LOGPROBS`` logprobs are bitwise those it
    gets alone in every composition ``(neighbour prompt lengths, target index, delay steps)``."""
    target = neighbour_ids(1000, prompt_len, vocab)
    params = SamplingParams(temperature=0, max_tokens=target_tokens, logprobs=LOGPROBS, ignore_eos=True)
    alone_ids, alone_lp = generate_among(llm, target, params, [], neighbour_tokens=target_tokens)
    assert len(alone_ids) == target_tokens
    for k, (lengths, index, delay) in enumerate(compositions):
        neighbours = [neighbour_ids(k * 100 + j, n, vocab) for j, n in enumerate(lengths)]
        ids, lp = generate_among(llm, target, params, neighbours, neighbour_tokens=target_tokens, target_index=index,
                                 delay_steps=delay)
        assert ids == alone_ids, f"composition {k}: tokens differ"
        assert lp == alone_lp, f"composition {k}: logprobs differ bitwise"


def repeating_target(vocab: int) -> list[int]:
    """The speculation tests' target prompt: 12 random ids twice, then the first 6 again."""
    half = neighbour_ids(1000, 12, vocab)
    return half + half + half[:6]


def check_fixed_speculation(llm: LLM, vocab: int, compositions: list[tuple[list[int], int, int]],
                            target_tokens: int) -> None:
    """Deterministic speculative decoding (``fixed`` plan, ``ngram`` drafts): a target whose prompt
    repeats itself (so drafts are found) gets bitwise the tokens and logprobs it gets alone, greedy and
    seeded-sampled, in every composition."""
    target = repeating_target(vocab)
    for params in (SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=77, max_tokens=12, logprobs=3, ignore_eos=True)):
        alone = generate_among(llm, target, params, [], neighbour_tokens=target_tokens)
        for k, (lengths, index, delay) in enumerate(compositions):
            neighbours = [neighbour_ids(k * 100 + j, n, vocab) for j, n in enumerate(lengths)]
            assert generate_among(llm, target, params, neighbours, neighbour_tokens=target_tokens,
                                  target_index=index, delay_steps=delay) == alone, f"composition {k}"
    assert llm.get_stats()["spec_decode"]["verify_steps"] > 0
