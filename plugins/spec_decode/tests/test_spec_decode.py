"""Speculative decoding end to end: greedy tokens identical with it on and off for every drafter and
plan, the output distribution of sampling unchanged (chi-square), bounded outputs, no leaked block."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from abort_drills import assert_preempted_then_aborts_free_every_block
from spec_setup import repeating_prompts, spec_plugins, write_oracle_file
from test_deepseek_v3 import CONFIGS as DEEPSEEK_CONFIGS
from test_deepseek_v3 import _build as build_deepseek
from tiny_models import BASE, TINY, save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _generate(folder: Path, prompts, params, plugins=None, **kw):
    llm = LLM(folder, block_size=16, plugins=plugins or {}, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module", params=["llama", "deepseek-v3"])
def tiny_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek-v3":
        build_deepseek(sorted(DEEPSEEK_CONFIGS)[0], folder)
        return folder
    return save_tiny(request.param, folder)[1]


@pytest.mark.parametrize("plan", ["fixed", "varlen"])
@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_greedy_tokens_are_identical_with_speculation(tiny_dir, drafter, plan, tmp_path):
    prompts = repeating_prompts(8, 1)
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=i % 3 == 0) for i in range(8)]
    reference, _ = _generate(tiny_dir, prompts, params)
    oracle = write_oracle_file(tmp_path, prompts, reference)
    spec = spec_plugins(drafter, plan, oracle_file=oracle, oracle_corruption=0.3)
    out, llm = _generate(tiny_dir, prompts, params, spec)
    assert out == reference
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    spec = stats["spec_decode"]
    if drafter == "oracle":  # corruptions make rejections, known continuations acceptances and bonuses
        assert spec["verify_steps"] > 0 and 1.0 < spec["mean_acceptance_length"] < 5.0
        assert 0 < spec["acceptance_per_position"][0] < 1


@pytest.mark.parametrize("name", sorted(set(TINY) - {"llama"}))
def test_greedy_tokens_are_identical_with_speculation_on_every_tiny_config(name, tmp_path):
    folder = save_tiny(name, tmp_path / "m")[1]
    prompts = repeating_prompts(6, 4)
    params = SamplingParams(temperature=0, max_tokens=12)
    reference, _ = _generate(folder, prompts, params)
    oracle = write_oracle_file(tmp_path, prompts, reference)
    out, _ = _generate(folder, prompts, params, spec_plugins("oracle", "varlen", oracle_file=oracle))
    assert out == reference


def test_greedy_identity_survives_preemption_and_aborts(tmp_path):
    folder = save_tiny("llama", tmp_path / "m")[1]
    prompts = repeating_prompts(10, 2)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for _ in range(10)]
    reference, _ = _generate(folder, prompts, params, max_model_len=128)
    oracle = write_oracle_file(tmp_path, prompts, reference)
    out, llm = _generate(folder, prompts, params, spec_plugins("oracle", "fixed", oracle_file=oracle),
                         kv_cache_bytes=13 * 2 * 16 * 2 * 16 * 4 * 2, max_model_len=128)
    assert out == reference
    assert_preempted_then_aborts_free_every_block(llm, prompts, params)


def test_outputs_never_exceed_max_tokens_and_stop_inside_accepted_drafts(tmp_path):
    folder = save_tiny("llama", tmp_path / "m")[1]
    prompts = repeating_prompts(6, 3)
    free = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 6
    reference, _ = _generate(folder, prompts, free)
    oracle = write_oracle_file(tmp_path, prompts, reference)
    stops = [SamplingParams(temperature=0, max_tokens=m, stop_token_ids=[r[7]])
             for m, r in zip([1, 2, 5, 9, 13, 20], reference, strict=True)]
    expected = []
    for r, p in zip(reference, stops, strict=True):
        cut = r[:p.max_tokens]
        expected.append(cut[:cut.index(r[7]) + 1] if r[7] in cut else cut)
    spec = spec_plugins("oracle", "fixed", oracle_file=oracle, oracle_corruption=0.0)
    out, _ = _generate(folder, prompts, stops, spec)
    assert out == expected


def test_the_step_cost_model_learns_from_the_engines_decode_steps(tmp_path):
    """The core feeds every pure decode step's forward, sampler and drafting seconds to the step-cost
    model; ``get_stats()["step_cost"]`` shows what it learned and how well it predicted the steps."""
    folder = save_tiny("llama", tmp_path / "m")[1]
    prompts = repeating_prompts(4, 5)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    reference, plain = _generate(folder, prompts, params)
    assert "step_cost" not in plain.get_stats()  # no speculation, no step-cost model
    oracle = write_oracle_file(tmp_path, prompts, reference)
    out, llm = _generate(folder, prompts, params, spec_plugins("oracle", "varlen", oracle_file=oracle,
                                                               oracle_corruption=0.3))
    assert out == reference
    cost = llm.get_stats()["step_cost"]
    assert cost["predicted_steps"] >= 10
    assert cost["sampler_seconds_per_row"] > 0
    assert cost["draft_seconds_per_step"] + cost["draft_seconds_per_request"] > 0  # either may be 0 alone
    assert cost["prediction_error"] > 0  # wall-clock steps on a shared CPU are never predicted exactly


def _two_oracle_requests(tmp_path):
    """A tiny Llama with the exact ``oracle`` drafter under ``varlen``, two repeating prompts, greedy
    params and the tokens without speculation."""
    folder = save_tiny("llama", tmp_path / "m")[1]
    prompts = repeating_prompts(2, 5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    reference, _ = _generate(folder, prompts, params)
    oracle = write_oracle_file(tmp_path, prompts, reference)
    llm = LLM(folder, block_size=16, max_num_seqs=2,
              plugins=spec_plugins("oracle", "varlen", oracle_file=oracle, oracle_corruption=0.0))
    return llm, prompts, params, reference


def _count_drafting_requests(speculator) -> list[int]:
    """A list that gets the number of requests of every call of the speculator's drafter."""
    drafted: list[int] = []
    propose = speculator.drafter.propose
    speculator.drafter.propose = lambda inputs: drafted.append(int(inputs.last_tokens.shape[0])) or propose(inputs)
    return drafted


def test_drafting_pauses_while_varlen_verifies_nothing(tmp_path):
    """When no verified draft can pay (a step's cost explodes with its query tokens), varlen verifies
    none and the engine stops drafting: proposals come at the back-off steps only (1, 2, 4 … skipped
    between them), and the tokens are those of decoding without speculation. The step-cost model
    hears of drafting only from steps that drafted: a paused step is not a free drafting request."""
    from deepinfer.engine.speculation import PAUSE_LIMIT

    llm, prompts, params, reference = _two_oracle_requests(tmp_path)
    speculator = llm.engine.speculator

    class ExplodingCost:
        def step_time(self, q: int, *, requests: int = 0) -> float:
            return float(q) ** 4

        def step_times(self, q: torch.Tensor, *, requests: int = 0) -> torch.Tensor:
            return q.to(torch.float64) ** 4

        def observe(self, q: int, seconds: float, **measured) -> None:
            observed.append(measured)

    observed: list[dict] = []

    speculator.cost = ExplodingCost()
    drafted = _count_drafting_requests(speculator)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    steps = llm.get_stats()["steps"]
    proposals = [n for n in drafted if n]
    # Back-off 1, 2, 4, …: about log2 of the steps, never one per step.
    assert 0 < len(proposals) <= 2 + steps.bit_length() + steps // PAUSE_LIMIT
    drafting_steps = [m for m in observed if m["requests"]]
    assert len(drafting_steps) <= len(proposals) < len(observed)
    assert all(m["draft_seconds"] > 0 for m in drafting_steps)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()


def test_no_request_drafts_at_a_batch_size_where_the_plan_says_drafting_cannot_pay(tmp_path):
    """``VarlenPlan.drafting_pays`` answers per batch size (here: drafting pays alone, not with two requests):
    while both requests run nobody drafts, probes included (no proposal, no verification), and the drafting
    resumes once one request finished; tokens are those of decoding without speculation, every block back."""
    llm, prompts, params, reference = _two_oracle_requests(tmp_path)
    speculator = llm.engine.speculator
    asked: list[int] = []
    speculator.plan.drafting_pays = lambda batch, cost: asked.append(batch) or batch < 2
    short = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    drafted = _count_drafting_requests(speculator)
    outs = llm.generate(prompts, [short, params], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[0][:24], reference[1]]
    assert 2 in asked and 1 in asked
    steps = llm.get_stats()["steps"]
    assert max(drafted) == 1 and sum(drafted) < steps  # never both; the second alone drafts again
    assert llm.get_stats()["spec_decode"]["verify_steps"] > 0
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()


def test_a_gate_that_always_drafts_still_measures_the_plain_steps_host_time(tmp_path):
    """A gate that says drafting pays at every step would let no plain step run, and the step-cost model
    charges the host's own time only once it saw both kinds of step (``engine/cost.py``): drafting's would
    never be charged. While drafting steps alone were seen, rounds draft nothing until as many plain steps
    were; then drafting resumes. Tokens are those of decoding without speculation, every block back."""
    llm, prompts, params, reference = _two_oracle_requests(tmp_path)
    speculator = llm.engine.speculator
    speculator.plan.drafting_pays = lambda batch, cost: True
    cost = speculator.cost
    cost.min_samples = 3
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert len(cost.host_plain.samples) >= 3 and len(cost.host_drafting.samples) >= 3
    assert not cost.wants_plain_steps()
    stats = llm.get_stats()
    assert stats["spec_decode"]["mean_acceptance_length"] > 2  # drafting resumed after the plain rounds
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()


@pytest.mark.parametrize("explore", [True, False])
def test_a_probe_verifies_a_draft_so_a_pessimistic_plan_learns_again(tmp_path, monkeypatch, explore):
    """A calibrator taught by a few early rejections makes varlen grant nothing; the drafts are in fact
    always right. The probe after each drafting pause verifies its first draft anyway, the calibrator
    learns from it, and varlen verifies again; without that exploration it never would (the deadlock
    measured on the H200: 3 unlucky first verifications, then none in thousands of steps)."""
    from deepinfer.engine import speculation

    if not explore:
        monkeypatch.setattr(speculation, "EXPLORE_DRAFTS", 0)
    llm, prompts, params, reference = _two_oracle_requests(tmp_path)
    speculator = llm.engine.speculator

    class FixedPlusPerToken:  # a draft pays when its chance of acceptance is above B / (B + 3)
        def step_time(self, q: int, *, requests: int = 0) -> float:
            return q + 3.0

        def step_times(self, q: torch.Tensor, *, requests: int = 0) -> torch.Tensor:
            return q.to(torch.float64) + 3.0

        def observe(self, q: int, seconds: float, **measured) -> None:
            pass

    speculator.cost = FixedPlusPerToken()
    for _ in range(10):  # the oracle's raw confidence is 1.0 (corruption 0): calibrated to (0 + 2·0.95) / 12,
        speculator.drafter.calibrator.observe([1.0], 1, 0)  # below B / (B + 3) at one request or two
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    spec = llm.get_stats()["spec_decode"]
    if explore:
        assert spec["verify_steps"] >= 8 and spec["mean_acceptance_length"] > 2.0
    else:
        assert spec["verify_steps"] == 0
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()


def test_a_request_whose_drafts_go_unverified_pauses_alone(tmp_path):
    """The drafting pause is per request: under a plan that verifies the first request's drafts and never
    the second's, the second stops drafting (back-off 1, 2, 4 …) while the first drafts after every step,
    and the tokens are those of decoding without speculation."""
    from deepinfer.engine.speculation import PAUSE_LIMIT

    llm, prompts, params, reference = _two_oracle_requests(tmp_path)
    speculator = llm.engine.speculator

    class FirstRequestOnly:
        def budget(self, stale_confidence: torch.Tensor, cost) -> int:
            return int(stale_confidence.shape[0] + (stale_confidence[0] > 0).sum())

        def split(self, confidence: torch.Tensor, total: int) -> torch.Tensor:
            granted = torch.zeros(confidence.shape[0], dtype=torch.int64)
            granted[0] = total - confidence.shape[0]
            return granted

    speculator.plan = FirstRequestOnly()
    drafted = _count_drafting_requests(speculator)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    steps = llm.get_stats()["steps"]
    both = sum(1 for n in drafted if n == 2)
    assert both <= 2 + steps.bit_length() + steps // PAUSE_LIMIT
    assert sum(1 for n in drafted if n == 1) >= steps // 3  # the first request went on drafting
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.shutdown()


@pytest.mark.parametrize("draft_probs", [False, True], ids=["onehot", "probs"])
def test_sampled_tokens_follow_the_target_distribution(tmp_path, draft_probs):
    """Seeded requests with speculation on; the second and third output tokens (produced through
    verification) are compared with their exact marginals computed by transformers."""
    vocab = 12
    model, folder = save_tiny("llama", tmp_path / "m", vocab_size=vocab)
    prompt = [3, 7, 1, 4]
    params = SamplingParams(temperature=1.3, top_k=8, max_tokens=3, ignore_eos=True)
    n = 2500
    plugins = spec_plugins("oracle", "fixed", oracle_corruption=0.5, oracle_draft_probs=draft_probs, max_draft=2)
    llm = LLM(folder, block_size=16, plugins=plugins, max_num_seqs=256)
    outs = llm.generate([prompt] * n, [SamplingParams(**{**params.__dict__, "seed": i, "seq_seed": i})
                                       for i in range(n)], use_tqdm=False)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outs])
    assert llm.get_stats()["spec_decode"]["verify_steps"] > 0

    def filtered(logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits / params.temperature, dim=-1)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, probs.topk(params.top_k).indices, True)
        probs = probs * keep
        return probs / probs.sum(-1, keepdim=True)

    with torch.no_grad():
        seqs = torch.tensor([[*prompt, a, b] for a in range(vocab) for b in range(vocab)])
        logits = model(seqs).logits.double()
    p1 = filtered(logits[0, len(prompt) - 1])
    p2 = filtered(logits[::vocab, len(prompt)])  # [a] given t1 = a
    p3 = filtered(logits[:, len(prompt) + 1]).reshape(vocab, vocab, vocab)  # [a, b] given t1, t2
    joint12 = p1[:, None] * p2
    marg2 = joint12.sum(0)
    marg3 = (joint12[..., None] * p3).sum((0, 1))
    from test_sampling import _chi_square_p

    for column, expected in ((1, marg2), (2, marg3)):
        counts = torch.bincount(tokens[:, column], minlength=vocab).double()
        assert _chi_square_p(counts, expected.float()) > 1e-3


def test_bad_settings_fail_at_start_up_naming_the_field(tmp_path):
    folder = save_tiny("llama", tmp_path / "m")[1]
    with pytest.raises(ConfigError, match="ngram_min"):
        LLM(folder, plugins={"spec_decode": {"enabled": True, "ngram_min": 5, "ngram_max": 2}})
    with pytest.raises(ConfigError, match=r"speculative\.plan.*nope"):
        LLM(folder, plugins={"spec_decode": {"enabled": True, "plan": "nope"}})
    with pytest.raises(ConfigError, match="max_backtrack"):
        LLM(folder, plugins={"spec_decode": {"enabled": True}}, cache={"max_backtrack": 2})


def test_the_old_plugin_keys_and_the_speculative_section_give_identical_engines(tmp_path):
    """``plugins.spec_decode.{drafter,plan,max_draft}`` are aliases of ``speculative.*``: the same config,
    settings, engine info and tokens either way; the plugin's own section mirrors the core's values."""
    folder = save_tiny("llama", tmp_path / "m")[1]
    gen = torch.Generator().manual_seed(23)
    prompts = [torch.randint(3, BASE["vocab_size"], (4,), generator=gen).tolist() * 3 for _ in range(3)]
    params = SamplingParams(temperature=0.7, max_tokens=10, seed=5, ignore_eos=True)
    chosen = {"drafter": "ngram", "plan": "fixed", "max_draft": 3}
    old_ids, old = _generate(folder, prompts, params, plugins={"spec_decode": {"enabled": True, **chosen}})
    new_ids, new = _generate(folder, prompts, params, plugins={"spec_decode": {"enabled": True}}, speculative=chosen)
    try:
        assert old.engine.config == new.engine.config
        assert old.engine.config.plugins["spec_decode"] == {"enabled": True, **chosen}
        assert old.engine.spec_settings == new.engine.spec_settings
        assert (new.engine.spec_settings.drafter, new.engine.spec_settings.max_draft) == ("ngram", 3)
        assert old.engine.info == new.engine.info and new.engine.info.layout.max_backtrack == 4
        assert old_ids == new_ids
    finally:
        old.shutdown()
        new.shutdown()
    # One source setting both names differently is refused, naming both.
    with pytest.raises(ConfigError, match=r"plugins\.spec_decode\.max_draft=2 and speculative\.max_draft=3"):
        LLM(folder, plugins={"spec_decode": {"enabled": True, "max_draft": 2}}, speculative={"max_draft": 3})


def test_reference_knobs_map_onto_the_plugin(tmp_path, monkeypatch):
    folder = save_tiny("llama", tmp_path / "m")[1]
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    llm = LLM(folder, plugins={"spec_decode": {"enabled": True}})
    assert llm.engine.spec_settings.max_draft == 3 and llm.engine.spec_settings.plan == "fixed"
    assert llm.engine.info.max_draft == 3 and llm.engine.info.layout.max_backtrack == 4


@pytest.mark.parametrize("varlen, plan", [(None, "fixed"), ("1", "varlen"), ("0", "fixed")])
def test_use_nextn_decode_alone_turns_speculation_on(tmp_path, monkeypatch, varlen, plan):
    """As in the reference, DEEPINFER_USE_NEXTN_DECODE=k with no config enables the plugin with k drafts and
    the fixed plan, unless DEEPINFER_ENABLE_MTP_VARLEN=1; explicit config still wins."""
    folder = save_tiny("llama", tmp_path / "m")[1]
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    if varlen is not None:
        monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", varlen)
    llm = LLM(folder, kv_cache_bytes=1 << 22)
    assert llm.engine.spec_settings is not None and llm.engine.speculator is not None
    assert llm.engine.spec_settings.max_draft == 2 and llm.engine.spec_settings.plan == plan
    llm.shutdown()
    explicit = LLM(folder, kv_cache_bytes=1 << 22, plugins={"spec_decode": {"enabled": False}})
    assert explicit.engine.speculator is None
    explicit.shutdown()


def test_use_nextn_decode_0_turns_drafting_off(tmp_path, monkeypatch):
    """The reference's DEEPINFER_USE_NEXTN_DECODE=0 means no speculation: start-up succeeds, nothing is drafted,
    and the tokens are those of a run without the plugin."""
    folder = save_tiny("llama", tmp_path / "m")[1]
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=4, ignore_eos=True)
    plain = LLM(folder)
    want = plain.generate([[5, 6, 7, 5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    plain.shutdown()
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    llm = LLM(folder, plugins={"spec_decode": {"enabled": True}})
    assert llm.engine.spec_settings is None and llm.engine.speculator is None
    assert llm.engine.info.max_draft == 0 and llm.engine.info.layout.max_backtrack == 1
    assert llm.generate([[5, 6, 7, 5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids == want
    llm.shutdown()


QUOTE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
         "All that glitters is not gold.")


def test_smollm2_ngram_greedy_tokens_are_identical_and_drafts_get_accepted(smollm2_dir):
    """Real weights, real acceptance: the model is asked to copy text, which prompt lookup predicts."""
    messages = [[{"role": "user", "content": f"Repeat this text exactly, nothing else:\n{QUOTE}"}],
                [{"role": "user", "content": f"Copy the following sentences word for word:\n{QUOTE}"}],
                [{"role": "user", "content": "What is the capital of France?"}]]
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = LLM(smollm2_dir)
    reference = [o.outputs[0].token_ids for o in plain.chat(messages, params, use_tqdm=False)]
    plain.shutdown()
    for plan in ("fixed", "varlen"):
        llm = LLM(smollm2_dir, plugins={"spec_decode": {"enabled": True, "drafter": "ngram", "plan": plan}})
        out = [o.outputs[0].token_ids for o in llm.chat(messages, params, use_tqdm=False)]
        assert out == reference, plan
        spec = llm.get_stats()["spec_decode"]
        if plan == "fixed":  # varlen drafts only where its measured step costs say it pays: timing-dependent
            assert spec["mean_acceptance_length"] > 1.5 and spec["acceptance_per_position"][0] > 0.5, spec
        llm.shutdown()
