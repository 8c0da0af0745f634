"""The ``mtp`` drafter on a tiny DeepSeek-V4 whose checkpoint carries one upstream MTP depth (``mtp.0.*``).

transformers does not instantiate V4's MTP layer, so there is no oracle for its logits. What is checked:
its input is transformers' final hyper-connection streams; after every step the engine's drafts are
those of one MTP pass over the request's committed tokens from scratch (chunked prefill, verify steps
with accepted and rejected drafts, a batch); drafts do not depend on the batch or on slot reuse; greedy
outputs are identical with the drafter on and off (fixed and varlen plans, preemption, aborts, with every
block and state slot back); start-up builds dummy MTP layers or refuses a checkpoint without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from abort_drills import run_with_staged_aborts
from safetensors.torch import load_file, save_file
from spec_setup import check_drafts_every_step, known_drafts, running_with_drafts
from test_deepseek_v4 import BLOCK, VOCAB, build, greedy, make_llm, prompts, request_ctx

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.kv.pools import bytes_per_block, state_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS = 4  # v4-yarn's num_hidden_layers
K = 3  # drafts per step


def _spec(plan: str = "fixed", max_draft: int = K, drafter: str = "mtp") -> dict:
    return {"spec_decode": {"enabled": True, "drafter": drafter, "plan": plan, "max_draft": max_draft}}


def _write_mtp(folder: Path, seed: int = 5) -> None:
    """Upstream ``mtp.0.*`` tensors next to the main checkpoint: a sliding-window block (layer 2's, perturbed,
    without its compressor) and random fusion projections, norms and hc head."""
    gen = torch.Generator().manual_seed(seed)
    block = {n.removeprefix("model.layers.2."): t for n, t in load_file(str(folder / "model.safetensors")).items()
             if n.startswith("model.layers.2.") and ".compressor." not in n}
    tensors = {f"mtp.0.{n}": t + 0.02 * torch.randn(t.shape, generator=gen) for n, t in block.items()}
    for leaf, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("norm.weight", (64,)),
                        ("e_proj.weight", (64, 64)), ("h_proj.weight", (64, 64)), ("hc_head_fn", (2, 128)),
                        ("hc_head_base", (2,)), ("hc_head_scale", (1,))):
        scale = 0.1 if len(shape) == 2 else 1.0
        tensors[f"mtp.0.{leaf}"] = scale * torch.randn(shape, generator=gen)
    save_file(tensors, str(folder / "mtp.safetensors"))


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """(transformers main model, folder) of the tiny V4 with one MTP depth."""
    folder = tmp_path_factory.mktemp("v4-mtp")
    main = build("v4-yarn", folder)
    _write_mtp(folder)
    return main, folder


class FromScratch:
    """Greedy MTP drafts after a committed sequence, computed from scratch: the main model over the whole
    sequence, the MTP layer over positions 0..n−2 (next tokens ``seq[1:]``), then chained on its own
    output and drafts. A plain engine's model (no drafter), its MTP ring bound to a fresh tensor."""

    def __init__(self, folder: Path) -> None:
        self.llm = make_llm(folder)
        self.model = model = self.llm.engine.model
        assert len(model.mtp_layers) == 1  # loaded from the checkpoint even without a drafter
        e = self.llm.engine
        model.bind_mtp_cache([spec.allocate_state(2, e.max_backtrack + K, torch.float32, torch.device("cpu"))
                              for spec in model.mtp_cache_specs()])

    @torch.inference_mode()
    def streams(self, seq: list[int]) -> torch.Tensor:
        """The main model's final streams ``[n, hc_mult·H]`` over ``seq`` (the MTP layer's input)."""
        table = list(range(1, 2 + (len(seq) + K) // BLOCK))
        self.model.forward(torch.tensor(seq), request_ctx(self.llm.engine.runner.backends, 0, len(seq), table))
        return self.model.captured_hidden[LAYERS]

    @torch.inference_mode()
    def drafts(self, seq: list[int], k: int) -> tuple[list[int], list[float]]:
        backends, n = self.llm.engine.runner.backends, len(seq)
        table = list(range(1, 2 + (n + k) // BLOCK))
        streams = self.streams(seq)
        ctx = request_ctx(backends, 0, n - 1, table)
        h = self.model.mtp_hidden(streams[:n - 1], torch.tensor(seq[1:]), ctx.positions, ctx)[-1:]
        drafts: list[int] = []
        probs: list[float] = []
        for j in range(k):
            if j:
                ctx = request_ctx(backends, n - 2 + j, n - 1 + j, table)
                h = self.model.mtp_hidden(h, torch.tensor(drafts[-1:]), ctx.positions, ctx)
            p = torch.softmax(self.model.mtp_logits(h, ctx)[0], dim=-1)
            drafts.append(int(p.argmax()))
            probs.append(float(p.max()))
        return drafts, probs


def _assert_all_returned(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    kv = llm.engine.kv
    assert not kv.slots and len(kv.free_slots) == llm.engine.num_state_slots - 1


def test_the_mtp_input_is_the_final_streams_of_transformers(with_mtp):
    main, folder = with_mtp
    seq = prompts([29], seed=3)[0]
    ours = FromScratch(folder).streams(seq)
    kept: list[torch.Tensor] = []
    hook = main.model.layers[-1].register_forward_hook(
        lambda module, args, out: kept.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        main(torch.tensor([seq]))
    hook.remove()
    theirs = kept[0][0]  # the last decoder layer's output streams [n, m, H], before hc_head
    assert theirs.shape == (len(seq), 2, 64)
    torch.testing.assert_close(ours, theirs.flatten(1), rtol=0, atol=1e-4 * float(theirs.abs().max()))


@pytest.mark.parametrize("known", [False, True])
def test_drafts_are_a_fresh_mtp_pass_over_the_committed_tokens(with_mtp, known, monkeypatch):
    """Three requests, the longest prefilled in chunks, then verify steps: after every step each running
    request's drafts and raw confidences are those of the from-scratch pass. With ``known`` the proposals
    are replaced by the known continuation (partly corrupted): accepted drafts' ring rows and rolled-back
    ones are then in play, and the MTP's own confidences still equal the from-scratch pass."""
    _, folder = with_mtp
    reference = FromScratch(folder)
    batch = prompts([37, 9, 4], seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    if known:
        outputs = greedy(reference.llm, batch, max_new=12)
        known_drafts(monkeypatch, [p + o for p, o in zip(batch, outputs, strict=True)], VOCAB)
    llm = make_llm(folder, max_num_batched_tokens=16, plugins=_spec())
    engine = llm.engine
    assert engine.model.captured_layers == (LAYERS,) and engine.runner.keep_hidden
    for prompt in batch:
        engine.add(engine.make_request(prompt, params))
    checked = check_drafts_every_step(engine, K, reference.drafts, exact_tokens=not known)
    assert checked >= (8 if known else 20)
    stats = llm.get_stats()["spec_decode"]
    assert stats["verify_steps"] > 0 and (stats["mean_acceptance_length"] > 1.5) == known
    _assert_all_returned(llm)


def test_drafts_do_not_depend_on_the_batch_or_reused_slots(with_mtp):
    """The same request drafts the same tokens at every length alone in a fresh engine and batched with
    others in an engine whose state slots and blocks were used before."""
    _, folder = with_mtp
    batch = prompts([21, 6, 33], seed=8)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def drafts_by_length(llm: LLM, chosen: list[int]) -> dict[tuple[int, int], list[int]]:
        engine, seen = llm.engine, {}
        requests = [engine.make_request(batch[i], params) for i in chosen]
        owner = {r.request_id: i for r, i in zip(requests, chosen, strict=True)}
        for req in requests:
            engine.add(req)
        while engine.has_unfinished():
            engine.step()
            for req in running_with_drafts(engine):
                if req.draft_tokens:
                    seen[owner[req.request_id], req.num_tokens] = list(req.draft_tokens)
        return seen

    alone = drafts_by_length(make_llm(folder, plugins=_spec()), [1])
    busy = make_llm(folder, max_num_batched_tokens=24, plugins=_spec())
    drafts_by_length(busy, [0, 2])
    batched = drafts_by_length(busy, [2, 1, 0])
    assert len(alone) >= 5
    assert all(batched[key] == value for key, value in alone.items())
    _assert_all_returned(busy)


@pytest.mark.parametrize("plan", ["fixed", "varlen"])
def test_greedy_tokens_are_identical_with_mtp(with_mtp, plan, monkeypatch):
    """Real MTP drafts (random weights: rejected) and then known drafts with corruptions (accepted in part,
    the rest rolled back) leave greedy outputs unchanged."""
    _, folder = with_mtp
    batch = prompts([3, 31, 47, 12, 9, 20], seed=7)
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=i % 2 == 0) for i in range(6)]
    reference = [o.outputs[0].token_ids for o in make_llm(folder, max_num_batched_tokens=32).generate(
        batch, params, use_tqdm=False)]
    for known in (False, True):
        if known:
            known_drafts(monkeypatch, [p + r for p, r in zip(batch, reference, strict=True)], VOCAB)
        llm = make_llm(folder, max_num_batched_tokens=32, plugins=_spec(plan, max_draft=4))
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)] == reference
        stats = llm.get_stats()["spec_decode"]
        assert stats["verify_steps"] > 0 or plan == "varlen"
        if known and plan == "fixed":
            assert stats["mean_acceptance_length"] > 1.5
        _assert_all_returned(llm)


def test_mtp_survives_preemption_and_aborts_without_leaking(with_mtp, monkeypatch):
    _, folder = with_mtp
    batch = prompts([30, 17, 25, 8, 40, 22, 13, 35], seed=8)
    later = prompts([26, 11, 38, 19, 7, 33], seed=9)  # new prompts: the abort wave tests no prefix hit
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_llm(folder, max_model_len=96)
    reference, later_reference = greedy(plain, batch), greedy(plain, later)
    sequences = [p + r for p, r in zip(batch + later, reference + later_reference, strict=True)]
    known_drafts(monkeypatch, sequences, VOCAB)
    probe = make_llm(folder, plugins=_spec()).engine
    specs = [*probe.model.cache_specs(), *probe.model.mtp_cache_specs()]
    budget = (state_bytes(specs, probe.num_state_slots, probe.max_backtrack, torch.float32)
              + 13 * bytes_per_block(specs, BLOCK, torch.float32))
    llm = make_llm(folder, cache={"kv_cache_bytes": budget}, max_model_len=96, plugins=_spec())
    assert llm.get_stats()["kv_blocks_total"] == 12
    assert greedy(llm, batch) == reference
    assert llm.get_stats()["preemptions"] > 0
    _assert_all_returned(llm)
    reqs = [llm.engine.make_request(p, params) for p in later]
    run_with_staged_aborts(llm, reqs, stride=2)
    assert all(r.output_token_ids == want[:len(r.output_token_ids)]
               for r, want in zip(reqs, later_reference, strict=True))
    _assert_all_returned(llm)


def test_start_up_builds_or_refuses_mtp(with_mtp, tmp_path):
    _, folder = with_mtp
    auto = make_llm(folder, plugins=_spec(drafter="auto"))
    assert auto.engine.spec_settings.drafter == "mtp"
    assert len(auto.engine.pool.layers) == LAYERS + 1  # the MTP ring, in the same pool
    dummy = make_llm(folder, load_format="dummy", plugins=_spec())
    assert len(dummy.engine.model.mtp_layers) == 1
    out = greedy(dummy, prompts([12, 5], seed=4), max_new=6)
    assert [len(o) for o in out] == [6, 6]
    _assert_all_returned(dummy)

    build("v4-yarn", tmp_path)  # config.json declares num_nextn_predict_layers=1, no MTP tensors
    with pytest.raises(ConfigError, match=r"drafter='mtp'.*no complete MTP weights"):
        make_llm(tmp_path, plugins=_spec())
    fallback = make_llm(tmp_path, plugins=_spec(drafter="auto"))
    assert fallback.engine.spec_settings.drafter == "ngram" and not fallback.engine.model.captured_layers
