"""In-step prefix sharing (``cache.in_step_prefix_sharing``, engine/scheduler.py): requests admitted
together that share a prefix compute it once, so their hit rate equals that of admitting them one
after another, with the same tokens; an abort of the request computing the prefix releases the others."""

from __future__ import annotations

import pytest
import torch
from tiny_deepseek import save_tiny_v3
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.config import build_config
from deepinfer.errors import ConfigError
from deepinfer.kv.blocks import KVCacheManager

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
OVERLAP = {"scheduling": {"enabled": True}}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("sharing"))[1]


def _groups(seed: int, groups: int = 3, per_group: int = 4, shared: int = 70) -> list[list[int]]:
    """``groups`` × ``per_group`` prompts: each group's share ``shared`` tokens (4+ blocks of 16), then a
    tail of its own; interleaved, so a group's requests are not neighbours in the queue."""
    gen = torch.Generator().manual_seed(seed)
    heads = [torch.randint(0, 256, (shared,), generator=gen).tolist() for _ in range(groups)]
    tails = torch.randint(3, 30, (groups * per_group,), generator=gen).tolist()
    return [heads[i % groups] + torch.randint(0, 256, (n,), generator=gen).tolist() for i, n in enumerate(tails)]


def _llm(folder, sharing: bool = True, plugins=None, **kw) -> LLM:
    return LLM(folder, kv_cache_bytes=1 << 23, block_size=16, plugins=plugins or {},
               scheduler={"executor": "overlap" if plugins else "sync"}, cache={"in_step_prefix_sharing": sharing},
               **kw)


def _together(llm: LLM, prompts):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.get_stats()


def _one_by_one(llm: LLM, prompts):
    tokens = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    return tokens, llm.get_stats()


# (groups, shared prefix tokens, max_num_batched_tokens): all in one step; a 10-block prefix computed in
# chunks of 64 while the requests that share it queue (a sync chunked run admits one group after another
# on its own, so there one group shows the wait: the others are held through the last chunk).
CASES = {"one-step": (3, 70, None), "chunked": (1, 150, 64)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("plugins", [None, OVERLAP], ids=["sync", "overlap"])
def test_together_hits_like_one_by_one(llama_dir, case, plugins):
    groups, shared_tokens, budget = CASES[case]
    prompts = _groups(1, groups=groups, shared=shared_tokens)
    kw = {"max_num_batched_tokens": budget} if budget else {}
    serial, serial_stats = _one_by_one(_llm(llama_dir, plugins=plugins, **kw), prompts)
    shared_llm = _llm(llama_dir, plugins=plugins, **kw)
    shared, stats = _together(shared_llm, prompts)
    side_by_side, plain = _together(_llm(llama_dir, sharing=False, plugins=plugins, **kw), prompts)
    assert shared == serial == side_by_side
    ceiling = serial_stats["prefix_cache_hit_rate"]
    assert ceiling > 0.4
    assert abs(stats["prefix_cache_hit_rate"] - ceiling) <= 0.02 * ceiling
    assert stats["prefix_sharing_holds"] > 0 and plain["prefix_sharing_holds"] == 0
    # Side by side the shared blocks in progress are computed again: further from the ceiling than 2%.
    assert plain["prefix_cache_hit_rate"] < 0.98 * ceiling
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if plugins:
        assert type(shared_llm.engine.executor).__name__ == "OverlapExecutor"


def test_the_manager_names_blocks_in_progress_and_the_block_a_lookup_waits_for():
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
    tokens, other = list(range(14)), [*range(14), 99]
    assert kv.allocate("a", 14, kv.find_prefix("a", tokens))
    in_progress = kv.uncached_tail("a", tokens, 3)
    assert len(in_progress) == 3  # nothing computed yet
    hit = kv.find_prefix("b", other)
    assert hit.num_tokens == 0 and kv.next_block_hash("b", 15, hit) in in_progress
    kv.cache_full_blocks("a", tokens, 8)  # two blocks computed and registered
    assert len(kv.uncached_tail("a", tokens, 3)) == 1
    hit = kv.find_prefix("b", other)
    assert hit.num_tokens == 8 and kv.next_block_hash("b", 15, hit) == kv.uncached_tail("a", tokens, 3)[0]
    kv.cache_full_blocks("a", tokens, 14)
    hit = kv.find_prefix("b", other)
    assert kv.uncached_tail("a", tokens, 3) == [] and kv.next_block_hash("b", 15, hit) is None


def test_the_setting_is_on_by_default_and_validated():
    assert build_config(environ={}).config.cache.in_step_prefix_sharing is True
    off = build_config(environ={"DEEPINFER_CACHE__IN_STEP_PREFIX_SHARING": "false"})
    assert off.config.cache.in_step_prefix_sharing is False
    with pytest.raises(ConfigError, match=r"cache\.in_step_prefix_sharing"):
        build_config(overrides={"cache": {"in_step_prefix_sharing": "sometimes"}}, environ={})


def test_without_prefix_caching_nothing_is_held(llama_dir):
    llm = LLM(llama_dir, kv_cache_bytes=1 << 23, block_size=16, cache={"prefix_caching": False})
    tokens, stats = _together(llm, _groups(2))
    assert stats["prefix_sharing_holds"] == 0 and stats["prefix_cache_hit_rate"] == 0.0
    assert len(tokens) == 12


@pytest.mark.parametrize("plugins", [None, OVERLAP], ids=["sync", "overlap"])
def test_abort_of_the_computing_request_releases_the_held_ones(llama_dir, plugins):
    """A 9-block shared prefix computed in chunks of 100 by the first request, the others queued behind
    it. Overlapped, they are held after two steps (the first chunk is in flight, the last scheduled) and
    the first is aborted then; synchronous, a hold lasts only through the computing request's last chunk
    (it takes the whole budget until then, and that step is processed within one ``step()``), so it is
    aborted after its first chunk, and the second then computes the rest while the last two wait for it;
    overlapped, the blocks of its step in flight were registered when the step before was processed
    (steps run in order), so all three hit the nine blocks. Either way the others proceed, get the
    tokens they get alone, and no block leaks."""
    prompts = _groups(3, groups=1, per_group=4, shared=150)
    alone = [_one_by_one(_llm(llama_dir, sharing=False), [p])[0][0] for p in prompts[1:]]
    llm = _llm(llama_dir, plugins=plugins, max_num_batched_tokens=100)
    engine = llm.engine
    requests = [engine.make_request(p, GREEDY) for p in prompts]
    for req in requests:
        engine.add(req)
    for _ in range(2 if plugins else 1):
        engine.step()
    if plugins:
        assert llm.get_stats()["prefix_sharing_holds"] == 3
    assert [r.status.value for r in requests[1:]] == ["waiting"] * 3  # held behind the first, or queued
    assert engine.abort(requests[0].request_id)
    while engine.has_unfinished():
        engine.step()
    assert requests[0].finish_reason == "abort"
    assert [r.output_token_ids for r in requests[1:]] == alone
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["prefix_sharing_holds"] >= (3 if plugins else 2)
    assert stats["prefix_cache_hit_tokens"] >= 2 * 144  # at least the last two hit the nine shared blocks


def test_deepseek_v3_latent_cache(tmp_path):
    folder = save_tiny_v3(tmp_path / "v3")
    prompts = _groups(4, groups=2, per_group=3)
    serial, serial_stats = _one_by_one(_llm(folder), prompts)
    shared, stats = _together(_llm(folder), prompts)
    side_by_side, _ = _together(_llm(folder, sharing=False), prompts)
    assert shared == serial == side_by_side
    ceiling = serial_stats["prefix_cache_hit_rate"]
    assert ceiling > 0.4 and abs(stats["prefix_cache_hit_rate"] - ceiling) <= 0.02 * ceiling
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
