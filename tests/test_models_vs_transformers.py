"""The Llama-family model code against transformers on tiny random configs (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY, assert_cached_logits_match, assert_greedy_matches_generate, save_tiny

from deepinfer import LLM

DECODE_STEPS = 16


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    model, folder = save_tiny(request.param, tmp_path_factory.mktemp(request.param))
    return model, folder


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def test_prefill_and_cached_decode_logits_match(tiny):
    model, folder = tiny
    llm = LLM(folder, kv_cache_bytes=1 << 23, block_size=16)
    assert_cached_logits_match(llm, model, _prompts(256, [5, 23, 40, 17], seed=1), DECODE_STEPS)


def test_greedy_ids_match_generate_in_a_mixed_batch(tiny):
    model, folder = tiny
    llm = LLM(folder, kv_cache_bytes=1 << 23, block_size=16, max_num_batched_tokens=48)
    assert_greedy_matches_generate(llm, model, _prompts(256, [3, 31, 64, 12, 47, 9], seed=2))
