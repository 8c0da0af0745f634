"""No KV block is ever leaked: preemptions under a tiny budget and random aborts."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("blocks"))[1]


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=gen).tolist() for k in torch.randint(5, 40, (n,), generator=gen)]


def _kv_bytes(blocks: int) -> int:
    return blocks * 2 * 16 * 2 * 16 * 4 * 2  # blocks × (K+V) × block 16 × 2 kv heads × dim 16 × fp32 × 2 layers


def test_forced_preemption_recomputes_losslessly(tiny_dir):
    prompts = _prompts(10, 1)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=30, seed=9, ignore_eos=True)] * 5
    roomy = LLM(tiny_dir, kv_cache_bytes=1 << 23, block_size=16, max_model_len=128)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_dir, kv_cache_bytes=_kv_bytes(13), block_size=16, max_model_len=128)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    stats = tight.get_stats()
    assert stats["preemptions"] > 0
    assert got == want
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_random_aborts_and_preemptions_leak_nothing(tiny_dir):
    llm = LLM(tiny_dir, kv_cache_bytes=_kv_bytes(13), block_size=16, max_model_len=128, max_num_seqs=6)
    engine = llm.engine
    rng = random.Random(4)
    requests = [engine.make_request(p, SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 40), seed=i))
                for i, p in enumerate(_prompts(40, 2))]
    for req in requests:
        engine.add(req)
    finished: dict[str, str] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in finished, "a request finished twice"
            finished[out.request_id] = out.outputs[0].finish_reason
            assert len(out.outputs[0].token_ids) <= next(r for r in requests if r.request_id == out.request_id
                                                         ).params.max_tokens
        steps += 1
        if rng.random() < 0.3:
            live = [r.request_id for r in requests if r.request_id not in finished and not r.finished]
            if live:
                assert engine.abort(rng.choice(live))
    assert set(finished) == {r.request_id for r in requests}
    assert "abort" in finished.values() and "length" in finished.values()
    stats = llm.get_stats()
    assert stats["preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not engine.abort(requests[0].request_id)  # already gone
