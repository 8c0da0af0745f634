"""The ``mtp`` drafter on a tiny DeepSeek-V3 with MTP weights: its drafts are transformers' ``MtpModel``
chained on the committed sequence (prefill chunks, verify steps and a batch included), its cache rows
are those of a from-scratch MTP pass over the committed tokens (accepted drafts included), greedy
outputs are identical with it on and off (fixed and varlen, preemption, aborts, no leaked block), and
start-up resolves or refuses it by the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from abort_drills import run_with_staged_aborts
from deepinfer_spec_decode.mtp import choose_drafts
from safetensors import safe_open
from safetensors.torch import save_file
from spec_setup import check_drafts_every_step, known_drafts, running_with_drafts
from test_deepseek_v3 import _build as build_deepseek
from test_deepseek_v3_mtp import _mtp_checkpoint
from test_sampling import _chi_square_p

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.interfaces import ForwardContext
from deepinfer.kv.pools import KVPool

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16
VOCAB = 256


def _spec(plan: str = "fixed", max_draft: int = 3, drafter: str = "mtp") -> dict:
    return {"spec_decode": {"enabled": True, "drafter": drafter, "plan": plan, "max_draft": max_draft}}


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    """(transformers main model, its MtpModel, folder) of a tiny V3 whose checkpoint carries one MTP layer."""
    folder = tmp_path_factory.mktemp("v3-mtp")
    main = build_deepseek("v3-yarn", folder)
    return main, _mtp_checkpoint(main, folder), folder


def _reference_drafts(main, mtp, seq: list[int], k: int) -> tuple[list[int], list[float]]:
    """transformers' greedy MTP drafts after the committed tokens ``seq``: the MTP layer over positions
    0..n−2 (next tokens seq[1:]), then chained on its own hidden and drafts; with each draft's
    probability (softmax at temperature 1)."""
    n = len(seq)
    ids = torch.tensor([seq])
    cache = transformers.cache_utils.MtpCache(config=main.config.get_mtp_config())
    with torch.no_grad():
        hidden = main(ids, output_hidden_states=True).hidden_states[-1][:, :n - 1]
        h = mtp.forward_layer(0, hidden, torch.arange(n - 1)[None], cache, input_ids=ids[:, 1:])[:, -1:]
        drafts, probs = [], []
        for j in range(k):
            if j:
                h = mtp.forward_layer(0, h, torch.tensor([[n - 2 + j]]), cache, input_ids=torch.tensor([[drafts[-1]]]))
            p = torch.softmax(mtp._project_to_logits(h)[0, -1].float(), dim=-1)
            drafts.append(int(p.argmax()))
            probs.append(float(p.max()))
    return drafts, probs


def test_mtp_drafts_are_transformers_mtp_chained_on_the_committed_tokens(with_mtp):
    """Two requests, the longer one prefilled in two chunks (the first samples nothing, so only the MTP
    cache rows are written), then verify steps: after every step each running request's drafts are
    what transformers' MtpModel drafts from its committed tokens, and their raw confidences its
    probabilities."""
    main, mtp, folder = with_mtp
    k = 3
    llm = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22, max_num_batched_tokens=16,
              plugins=_spec(max_draft=k))
    engine = llm.engine
    for prompt in _prompts([21, 9], seed=5):
        engine.add(engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)))
    checked = check_drafts_every_step(engine, k, lambda ids, n: _reference_drafts(main, mtp, ids, n))
    assert checked >= 6
    stats = llm.get_stats()
    assert stats["spec_decode"]["verify_steps"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def _mtp_rows(model, caches, table: list[int], count: int) -> torch.Tensor:
    """The first ``count`` positions' rows of MTP layer 0's latent cache over block ``table``."""
    rows = caches[0][0] if caches is not None else model.mtp_layers[0].block.self_attn.kv_cache[0]
    return torch.stack([rows[table[p // BLOCK], p % BLOCK] for p in range(count)])


def test_mtp_cache_rows_are_a_fresh_pass_over_the_committed_tokens(with_mtp, tmp_path, monkeypatch):
    """With drafts that get accepted, after every step the MTP cache rows of every computed position of
    every running request equal those of one MTP pass over its committed tokens from scratch: accepted
    drafts' rows are written, chained rows past the committed length are overwritten, and chunks line up."""
    _, _, folder = with_mtp
    prompts = _prompts([37, 12, 5], seed=6)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    ref = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22)
    reference = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    known_drafts(monkeypatch, [p + r for p, r in zip(prompts, reference, strict=True)], VOCAB)
    model = ref.engine.model
    fresh = KVPool(model.mtp_cache_specs(), ref.engine.pool.num_blocks, BLOCK, torch.float32, torch.device("cpu"))
    model.bind_mtp_cache(fresh.layers)

    llm = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22, max_num_batched_tokens=24,
              plugins=_spec(max_draft=4))
    engine = llm.engine
    requests = [engine.make_request(p, params) for p in prompts]
    for req in requests:
        engine.add(req)
    compared = 0
    while engine.has_unfinished():
        engine.step()
        for req in engine.scheduler.running:
            m = req.num_computed_tokens
            seq = torch.tensor(req.all_token_ids[:m + 1])
            table = list(range(1, 1 + -(-m // BLOCK)))
            ctx = ForwardContext(
                positions=torch.arange(m), slot_mapping=torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK
                                                                      for p in range(m)]),
                query_start_loc=torch.tensor([0, m], dtype=torch.int32), seq_lens=torch.tensor([m]),
                block_tables=torch.tensor([table]), num_decodes=0, query_start_loc_host=[0, m], seq_lens_host=[m],
                block_size=BLOCK, backends=ref.engine.runner.backends)
            with torch.inference_mode():
                model.mtp_hidden(model.forward(seq[:m], ctx), seq[1:], ctx.positions, ctx)
            ours = _mtp_rows(engine.model, None, engine.kv.table(req.request_id), m)
            theirs = _mtp_rows(model, fresh.layers, table, m)
            assert torch.allclose(ours, theirs, atol=1e-4), (req.request_id, m, (ours - theirs).abs().max())
            compared += 1
    assert compared >= 10
    out = [r.output_token_ids for r in requests]
    assert out == reference
    stats = llm.get_stats()
    assert stats["spec_decode"]["mean_acceptance_length"] > 1.5  # accepted drafts were committed
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("plan", ["fixed", "varlen"])
def test_greedy_tokens_are_identical_with_mtp(with_mtp, plan):
    _, _, folder = with_mtp
    prompts = _prompts([3, 31, 47, 12, 9, 20], seed=7)
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=i % 2 == 0) for i in range(6)]
    plain = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22, max_num_batched_tokens=32)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22, max_num_batched_tokens=32,
              plugins=_spec(plan, max_draft=4))
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out == reference
    stats = llm.get_stats()
    assert stats["spec_decode"]["verify_steps"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_mtp_survives_preemption_and_aborts_without_leaking_blocks(with_mtp):
    _, _, folder = with_mtp
    prompts = _prompts([30, 17, 25, 8, 40, 22, 13, 35], seed=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22, max_model_len=96)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    # 4608 bytes per block for the main layers + 1536 for the MTP layer: 13 blocks, 12 usable.
    llm = LLM(folder, block_size=BLOCK, kv_cache_bytes=13 * 6144, max_model_len=96, plugins=_spec(max_draft=3))
    assert llm.get_stats()["kv_blocks_total"] == 12
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out == reference
    stats = llm.get_stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    run_with_staged_aborts(llm, [llm.engine.make_request(p, params) for p in prompts], stride=3)
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_sampling_requests_get_drafts_drawn_from_the_reported_probs(with_mtp):
    """A batch mixing greedy and sampling requests: the proposal carries distributions (one-hot for
    greedy rows), each sampling draft is a token the distribution allows, greedy outputs stay exact."""
    _, _, folder = with_mtp
    prompts = _prompts([14, 6, 23], seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22)
    reference = plain.generate([prompts[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22, plugins=_spec(max_draft=2))
    engine = llm.engine
    sampled = [SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=s) for s in (1, 2)]
    reqs = [engine.make_request(p, sp) for p, sp in zip(prompts, [greedy, *sampled], strict=True)]
    for req in reqs:
        engine.add(req)
    seen = 0
    while engine.has_unfinished():
        engine.step()
        for req in (r for r in running_with_drafts(engine) if r.draft_tokens):
            probs, n = req.draft_probs, len(req.draft_tokens)
            if probs is None:  # only a batch of greedy requests reports no distribution (one-hot)
                assert req.params.greedy
                continue
            assert probs.shape == (n, VOCAB)
            assert torch.allclose(probs.sum(-1), torch.ones(n), atol=1e-5)
            picked = probs[torch.arange(n), torch.tensor(req.draft_tokens)].tolist()
            if req.params.greedy:
                assert picked == [1.0] * n
            else:  # the confidence of a sampled draft is its probability under the reported distribution
                assert picked == pytest.approx(req.draft_raw_confidence, abs=1e-6)
                seen += 1
    assert seen >= 4
    assert reqs[0].output_token_ids == reference
    assert all(len(r.output_token_ids) == 8 for r in reqs)


def test_choose_drafts_takes_the_argmax_or_draws_from_its_distribution():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 10, generator=gen) * 2
    n = 4000
    temperature = torch.tensor([0.0] * 2 + [0.7] * n)
    seeds = torch.arange(n + 2)
    tokens, probs, confidence = choose_drafts(logits.expand(n + 2, -1), temperature, seeds, torch.full((n + 2,), 9))
    soft = torch.softmax(logits[0], -1)
    assert tokens[:2].tolist() == [int(logits.argmax())] * 2
    assert torch.equal(probs[0], torch.zeros(10).scatter_(0, logits.argmax(-1), 1.0))
    assert confidence[:2].tolist() == pytest.approx([float(soft.max())] * 2)
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(probs[2:], expected.expand(n, -1))
    assert torch.allclose(confidence[2:], expected[tokens[2:]])
    assert _chi_square_p(torch.bincount(tokens[2:], minlength=10).double(), expected.double()) > 1e-3
    again, _, _ = choose_drafts(logits.expand(n + 2, -1), temperature, seeds, torch.full((n + 2,), 9))
    assert torch.equal(tokens, again)  # counter draws: the same seed and position give the same draft


def test_choose_drafts_without_sampling_requests_equals_the_greedy_rows_of_the_full_path():
    """When the host knows no request samples (``sampling=False``), drafts and confidences are bitwise
    those of the full path's greedy rows, without a distribution."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(4)) * 3
    zeros, seeds, positions = torch.zeros(6), torch.arange(6), torch.arange(6) + 20
    tokens, probs, confidence = choose_drafts(logits, zeros, seeds, positions)
    fast_tokens, fast_probs, fast_confidence = choose_drafts(logits, zeros, seeds, positions, sampling=False)
    assert fast_probs is None and probs is not None
    assert torch.equal(fast_tokens, tokens) and torch.equal(fast_confidence, confidence)


def test_start_up_resolves_mtp_by_the_checkpoint(with_mtp, tmp_path):
    _, _, folder = with_mtp
    auto = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22, plugins=_spec(drafter="auto"))
    assert auto.engine.spec_settings.drafter == "mtp" and auto.engine.runner.keep_hidden
    assert len(auto.engine.pool.layers) == len(auto.engine.model.cache_specs()) + 1  # the MTP cache, same pool
    dummy = LLM(folder, block_size=BLOCK, kv_cache_bytes=1 << 22, load_format="dummy", plugins=_spec())
    assert len(dummy.engine.model.mtp_layers) == 1
    out = dummy.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4

    bare = tmp_path / "no-mtp"
    bare.mkdir()
    build_deepseek("v3-yarn", bare)  # config.json declares num_nextn_predict_layers=1, no MTP tensors
    with pytest.raises(ConfigError, match=r"drafter='mtp'.*no complete MTP weights.*num_nextn_predict_layers=1"):
        LLM(bare, block_size=BLOCK, kv_cache_bytes=1 << 22, plugins=_spec())
    fallback = LLM(bare, block_size=BLOCK, kv_cache_bytes=1 << 22, plugins=_spec(drafter="auto"))
    assert fallback.engine.spec_settings.drafter == "ngram" and not fallback.engine.runner.keep_hidden

    # An MTP layer with a tensor missing is dropped at load: the same start-up error.
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in folder.iterdir():
        (partial / f.name).write_bytes(f.read_bytes())
    shard = partial / "model-00002-of-00002.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        names = f.keys()  # a safe_open handle is not iterable itself
        tensors = {name: f.get_tensor(name) for name in names if not name.endswith("hnorm.weight")}
    save_file(tensors, str(shard))
    index = json.loads((partial / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if not n.endswith("hnorm.weight")}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="no complete MTP weights"):
        LLM(partial, block_size=BLOCK, kv_cache_bytes=1 << 22, plugins=_spec())

    v2 = tmp_path / "v2"
    v2.mkdir()
    build_deepseek("v2-greedy", v2)  # no MTP layers declared: refused before any weight is read
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        LLM(v2, block_size=BLOCK, kv_cache_bytes=1 << 22, plugins=_spec())
