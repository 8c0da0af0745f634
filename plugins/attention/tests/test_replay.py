"""The ``bounded`` replay planner (``plugins.attention.replay``) on tiny random models, fp32 on CPU.

YoCo prefill truncation on a DeepSeek-V4 with 2 producer and 2 consumer layers (window 8): compact and
mask agree on every kept row, a keep longer than the prompt changes nothing. Bounded restore after
prefix-cache hits and preemptions on that V4 and on a Gemma-3: with ``keep_tokens`` past the receptive
field it equals the exact restore, with a small one it differs, runs, and leaks no block. Start-up
checks, prompt logprobs refused, the reference's env knobs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepinfer_attention.config import AttentionConfig
from spec_setup import spec_plugins, write_oracle_file
from test_deepseek_v4 import CONVERSATIONS, _blocks_budget, build, make_llm, prompts, request_ctx
from test_gemma3 import build_gemma3

from deepinfer import LLM, SamplingParams
from deepinfer.config import build_config
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Restore
from deepinfer.errors import ConfigError
from deepinfer.outputs import RequestOutput
from deepinfer.plugins import config_aliases, discover_plugins

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8  # the tiny V4's sliding window (test_deepseek_v4.V4_BASE); max_backtrack is 1
MIN_KEEP = WINDOW + 1
PROMPTS = prompts([70, 45, 9], seed=5)
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)


def replay(**fields: object) -> dict[str, object]:
    return {"attention": {"enabled": True, "replay": fields}}


@pytest.fixture(scope="module")
def yoco(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("yoco")
    build("v4-yarn", folder, yoco_num_producer_layers=2)
    return folder


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gemma")
    build_gemma3("gemma3-softcap").save_pretrained(folder)
    return folder


def run(llm: LLM, batches: list[list[list[int]]]) -> list[RequestOutput]:
    """Generate the batches one after the other (later ones hit the earlier ones' cached blocks), then
    check that every KV block came back."""
    outs = [o for batch in batches for o in llm.generate(batch, PARAMS, use_tqdm=False)]
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return outs


def ids(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def logprob_gap(a: list[RequestOutput], b: list[RequestOutput]) -> float:
    """The largest difference of the sampled tokens' logprobs (greedy ids must agree)."""
    assert ids(a) == ids(b)
    gaps = [abs(ra[t] - rb[t]) for oa, ob in zip(a, b, strict=True)
            for t, ra, rb in zip(oa.outputs[0].token_ids, oa.outputs[0].logprobs, ob.outputs[0].logprobs,
                                 strict=True)]
    return max(gaps)


def record_restores(llm: LLM) -> list[Restore]:
    """Keep every restore the engine's scheduler decides from now on."""
    replay_start = llm.engine.scheduler.replay
    assert replay_start is not None
    decide, restores = replay_start.restore, []

    def recorded(req: Request, computed: int) -> Restore:
        restores.append(decide(req, computed))
        return restores[-1]

    object.__setattr__(replay_start, "restore", recorded)  # a frozen dataclass: set on the instance
    return restores


def differs(a: list[RequestOutput], b: list[RequestOutput]) -> bool:
    """Whether the outputs differ in a token or in a sampled token's logprob by more than 1e-4."""
    return ids(a) != ids(b) or logprob_gap(a, b) > 1e-4


# ------------------------------------------------------------------------------ prefill truncation


def _prefill_rows(llm: LLM, mode: str | None, table: list[int], slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill the 70-token prompt in chunks [0, 40) and [40, 70) with truncation ``mode`` (None: off),
    floor 70 − MIN_KEEP; returns the second chunk's hidden rows and their logits."""
    model = llm.engine.model
    prompt = torch.tensor(PROMPTS[0])
    hidden = None
    for start, end in ((0, 40), (40, 70)):
        ctx = request_ctx(llm.engine.runner.backends, start, end, table, slot)
        if mode is not None:
            ctx.truncation_floor_host = [70 - MIN_KEEP]
            ctx.truncation_compact_host = [mode == "compact"]
        with torch.inference_mode():
            hidden = model.forward(prompt[start:end], ctx)
            logits = model.compute_logits(hidden, ctx)
    assert hidden is not None
    return hidden, logits


def test_compact_and_mask_agree_on_every_kept_row(yoco):
    """Model level: the second chunk's logits of every position past the floor are the same in both
    modes (the first chunk lies wholly below it: compact keeps just its last row); compact's dropped
    rows are zeros; and the truncation is real (mode off differs)."""
    llm = make_llm(yoco)
    kept = slice(70 - MIN_KEEP - 40, 30)
    mask_hidden, mask = _prefill_rows(llm, "mask", [1, 2, 3, 4, 5], 1)
    compact_hidden, compact = _prefill_rows(llm, "compact", [6, 7, 8, 9, 10], 2)
    _, off = _prefill_rows(llm, None, [11, 12, 13, 14, 15], 3)
    assert torch.allclose(mask[kept], compact[kept], atol=1e-5, rtol=0)
    assert torch.equal(mask[kept].argmax(-1), compact[kept].argmax(-1))
    assert compact_hidden[:kept.start].abs().max() == 0 and mask_hidden[:kept.start].abs().max() > 0
    assert (off[kept] - mask[kept]).abs().max() > 1e-3


def test_compact_and_mask_generate_alike_and_free_every_block(yoco):
    """Engine level, chunked prefill (32-token budget) in a batch: both modes give the same tokens with
    logprobs within 1e-5."""
    outs = {mode: run(make_llm(yoco, plugins=replay(mode=mode, keep_tokens=MIN_KEEP), max_num_batched_tokens=32),
                      [PROMPTS]) for mode in ("mask", "compact")}
    assert logprob_gap(outs["mask"], outs["compact"]) < 1e-5


def test_keep_beyond_the_prompt_equals_no_truncation(yoco):
    off = run(make_llm(yoco, max_num_batched_tokens=32), [PROMPTS])
    for mode in ("mask", "compact"):
        llm = make_llm(yoco, plugins=replay(mode=mode, keep_tokens=128), max_num_batched_tokens=32)
        assert logprob_gap(off, run(llm, [PROMPTS])) < 1e-5


def test_prompt_logprobs_are_refused_while_truncating(yoco):
    llm = make_llm(yoco, plugins=replay(mode="compact", keep_tokens=MIN_KEEP))
    with pytest.raises(ValueError, match=r"prompt_logprobs is not available .*mode 'compact'.*position 61"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert len(run(llm, [PROMPTS[:1]])[0].outputs[0].token_ids) == PARAMS.max_tokens


# ------------------------------------------------------------------------------ bounded restore


def test_bounded_restore_past_the_receptive_field_equals_exact_restore(yoco):
    """Two waves of conversations sharing 96 cached tokens: keep 64 reaches past the receptive field
    (4 layers × (8 + 1) + 2 × 8 = 52), so the restore is exact; keep 9 rebuilds the rings from 9 tokens
    and changes the later wave's outputs (truncation on too: both act together)."""
    waves = [CONVERSATIONS[:1], CONVERSATIONS[1:]]
    exact = run(make_llm(yoco), waves)
    assert make_llm(yoco).engine.info.layout.max_backtrack == 1
    wide = make_llm(yoco, plugins=replay(restore="bounded", keep_tokens=64))
    assert logprob_gap(exact, run(wide, waves)) < 1e-5
    assert wide.get_stats()["prefix_cache_hit_rate"] > 0.4
    narrow = run(make_llm(yoco, plugins=replay(restore="bounded", keep_tokens=MIN_KEEP, mode="compact")), waves)
    assert ids(narrow[:1]) == ids(exact[:1]) and differs(narrow[1:], exact[1:])


def test_bounded_restore_after_preemption_runs_and_frees_every_block(yoco):
    budget = _blocks_budget(make_llm(yoco), 12)
    tight = {"cache": {"kv_cache_bytes": budget}, "max_model_len": 128, "max_num_batched_tokens": 64}
    mixed = prompts([31, 64, 12, 47], seed=2)
    llm = make_llm(yoco, plugins=replay(restore="bounded", keep_tokens=MIN_KEEP), **tight)
    restores = record_restores(llm)
    outs = run(llm, [mixed])
    assert llm.get_stats()["preemptions"] > 0
    assert any(r.floor > 0 and r.cached - r.first <= 2 * WINDOW for r in restores)  # bounded, not exact
    assert all(len(t) == PARAMS.max_tokens for t in ids(outs))


def test_bounded_restore_composes_with_spec_decode_and_the_overlapped_executor(yoco, tmp_path):
    """Bounded restore (with compact truncation) after prefix hits gives the plain synchronous run's
    greedy tokens and logprobs under speculative decoding — drafts accepted and rejected, so rings
    restored from ``keep_tokens`` are rolled back too — under the overlapped executor, and under both;
    every block comes back."""
    waves = [CONVERSATIONS[:1], CONVERSATIONS[1:]]
    bounded = replay(restore="bounded", keep_tokens=WINDOW + 5, mode="compact")  # window + max_backtrack (4 drafts)
    plain = run(make_llm(yoco, plugins=bounded), waves)
    # The oracle drafts the known continuations with a third of its drafts corrupted: accepts and rejections.
    oracle = write_oracle_file(tmp_path, [p for wave in waves for p in wave], ids(plain))
    spec = {**bounded, **spec_plugins("oracle", "fixed", oracle_file=oracle, oracle_corruption=0.3)}
    overlap = {"scheduling": {"enabled": True}}
    for plugins in (spec, {**bounded, **overlap}, {**spec, **overlap}):
        llm = make_llm(yoco, plugins=plugins, scheduler={"executor": "overlap" if "scheduling" in plugins else "sync"})
        restores = record_restores(llm)
        assert logprob_gap(plain, run(llm, waves)) < 1e-5
        assert any(r.floor > 0 for r in restores)  # the second wave restored from its cached blocks
        if "spec_decode" in plugins:  # some drafts accepted, some rejected
            assert 1 < llm.get_stats()["spec_decode"]["mean_acceptance_length"] < 5


def test_gemma3_bounded_restore(gemma):
    """Gemma-3's sliding layers keep full paged KV: a bounded restore recomputes the replayed tokens in
    blocks of their own with the windows blind below them. keep ≥ the cached prefix recomputes it all,
    as without the cache; a small keep differs; every block comes back."""
    waves = [CONVERSATIONS[:1], CONVERSATIONS[1:]]

    def llm(**kw: object) -> LLM:
        return LLM(gemma, cache={"kv_cache_bytes": 1 << 22, "block_size": 16, **kw.pop("cache", {})}, **kw)

    exact = run(llm(), waves)
    assert logprob_gap(exact, run(llm(cache={"prefix_caching": False}), waves)) < 1e-5
    assert logprob_gap(exact, run(llm(plugins=replay(restore="bounded", keep_tokens=128)), waves)) < 1e-5
    narrow = llm(plugins=replay(restore="bounded", keep_tokens=13))
    assert differs(run(narrow, waves)[1:], exact[1:])
    assert 0 < narrow.get_stats()["prefix_cache_hit_rate"] < 0.6  # the hit is cut back to whole blocks


# ------------------------------------------------------------------------------ configuration


def test_too_small_keep_tokens_fails_at_start_up_naming_both_numbers(yoco):
    with pytest.raises(ConfigError, match=r"keep_tokens=5 is too small: .* sliding window \(8\) \+ "
                                          r"cache\.max_backtrack \(1\) = 9"):
        make_llm(yoco, plugins=replay(mode="mask", keep_tokens=5))
    with pytest.raises(ConfigError, match=r"cache\.max_backtrack \(3\) = 11"):
        make_llm(yoco, plugins=replay(restore="bounded", keep_tokens=10), cache={"max_backtrack": 3})


def test_settings_that_cannot_act_are_refused(yoco, gemma):
    with pytest.raises(ConfigError, match=r"cache\.replay is 'exact'"):
        make_llm(yoco, plugins=replay(mode="compact"), cache={"replay": "exact"})
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM has none"):
        LLM(gemma, kv_cache_bytes=1 << 22, block_size=16, plugins=replay(mode="mask"))


def test_reference_env_knobs_map_onto_the_replay_section():
    aliases = config_aliases(discover_plugins())
    env = {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "256",
           "DEEPINFER_PLUGINS__ATTENTION__ENABLED": "1"}
    cfg = build_config(environ=env, aliases=aliases).config
    section = cfg.plugins["attention"]
    assert section["enabled"] in (True, 1)
    replay_config = AttentionConfig.model_validate({"replay": section["replay"]}).replay
    assert (replay_config.mode, replay_config.keep_tokens) == ("compact", 256)
    off = build_config(environ={"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "off"}, aliases=aliases).config
    assert AttentionConfig.model_validate({"replay": off.plugins["attention"]["replay"]}).replay.mode == "off"
