"""The ``dspark`` block drafter: lossless on Llama and DeepSeek-V3 whatever it drafts, drafts of the right
shape, weights that round-trip through the documented safetensors layout, the Markov correction and
confidence head on a hand-made example, no leaked block under preemption and aborts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from abort_drills import assert_preempted_then_aborts_free_every_block
from deepinfer_spec_decode.config import SpecDecodeConfig
from deepinfer_spec_decode.dspark import DSparkDrafter, DSparkNetwork, context_bytes_per_slot, draft_block, save_weights
from safetensors.torch import load_file, save_file
from test_deepseek_v3 import CONFIGS as DEEPSEEK_CONFIGS
from test_deepseek_v3 import _build as build_deepseek
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.interfaces import DraftProposal

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 4
VOCAB = 256
KV_BYTES = 1 << 22  # a small pool: allocating the default one dominates a tiny model's start-up


def _spec(plan: str = "fixed", **extra) -> dict:
    return {"spec_decode": {"enabled": True, "drafter": "dspark", "plan": plan, "max_draft": K,
                            "dspark_weights": "random", **extra}}


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 30, (), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _llm(folder: Path, plugins=None, **kw) -> LLM:
    return LLM(folder, block_size=16, plugins=plugins or {}, **{"kv_cache_bytes": KV_BYTES, **kw})


def _generate(folder: Path, prompts, params, plugins=None, **kw) -> tuple[list[list[int]], LLM]:
    llm = _llm(folder, plugins, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def _dspark(llm: LLM) -> DSparkDrafter:
    drafter = llm.engine.speculator.drafter
    return getattr(drafter, "inner", drafter)  # under the plugin's calibration wrapper


def _record(llm: LLM) -> list[DraftProposal]:
    """Keep every proposal the dspark drafter makes."""
    drafter = _dspark(llm)
    proposals: list[DraftProposal] = []
    propose = drafter.propose

    def recording(inputs):
        proposal = propose(inputs)
        proposals.append(proposal)
        return proposal

    drafter.propose = recording
    return proposals


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))[1]


@pytest.fixture(scope="module", params=["llama", "deepseek-v3"])
def tiny_dir(request, llama_dir, tmp_path_factory) -> Path:
    if request.param == "llama":
        return llama_dir
    folder = tmp_path_factory.mktemp("deepseek")
    build_deepseek(sorted(DEEPSEEK_CONFIGS)[0], folder)
    return folder


def test_greedy_tokens_are_identical_with_dspark_under_both_plans(tiny_dir):
    prompts = _prompts(6, 1)
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=i % 2 == 0) for i in range(6)]
    reference, _ = _generate(tiny_dir, prompts, params)
    for plan in ("fixed", "varlen"):
        out, llm = _generate(tiny_dir, prompts, params, _spec(plan))
        assert out == reference, plan
        stats = llm.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["spec_decode"]["verify_steps"] > 0
        hidden = llm.engine.model.embed_tokens.weight.shape[1]
        layers = llm.engine.runner.hidden_layers
        assert layers and _dspark(llm).network.main_proj.weight.shape == (hidden, hidden * len(layers))


def check_window_and_plant(drafter: DSparkDrafter, inputs, proposal: DraftProposal,
                           features_of: Callable[[list[int]], torch.Tensor], full: dict[tuple[int, ...], list[int]],
                           window: int, gen: torch.Generator, vocab: int) -> DraftProposal:
    """At a draft: each request's context window equals ``context_kv`` of its committed tokens' features
    (``features_of``, recomputed from scratch); then the proposal with accepted drafts planted — the reference
    continuation (``full``: prompt → prompt + reference reply) for a random number of leading drafts, a wrong
    token after — so rows committed by verification enter the cache."""
    slots, visible = drafter.window_slots(inputs.rows, inputs.positions - 1)
    context = drafter.context[slots]
    tokens = proposal.tokens.clone()
    for b, history in enumerate(inputs.history.tolist()):
        committed = [t for t in history if t >= 0]
        features = features_of(committed[:-1])
        last = len(committed) - 2
        pos = torch.arange(last - window + 1, last + 1).clamp_min(0)
        expected = drafter.network.context_kv(features[pos], pos)
        torch.testing.assert_close(context[b][visible[b]], expected[visible[b]], atol=1e-4, rtol=1e-4)
        assert visible[b].sum() == min(window, last + 1)
        whole = next(f for p, f in full.items() if tuple(committed[:len(p)]) == p)
        right = whole[len(committed):len(committed) + inputs.k]
        keep = int(torch.randint(0, inputs.k + 1, (), generator=gen))
        for i, t in enumerate(right[:keep]):
            tokens[b, i] = t
        if keep < len(right):
            tokens[b, keep] = (right[keep] + 1) % vocab
    return DraftProposal(tokens, proposal.probs, proposal.confidence)


@pytest.mark.parametrize("pauses", [False, True], ids=["every_step", "with_pauses"])
def test_context_cache_equals_a_from_scratch_recomputation_at_every_step(tiny_dir, pauses):
    """Chunked prefill, a batch, accepted and rejected drafts: at every draft the window the drafter reads
    from its context cache equals ``context_kv`` of features recomputed by teacher forcing the request's
    committed tokens from scratch. Accepted drafts are planted (the reference continuation for a random
    number of leading drafts, a wrong token after), so rows committed by verification enter the cache.
    ``with_pauses``: about half the drafting steps draft for nobody (as when every request's drafting is
    paused), so the drafter keeps several steps' rows unwritten — a rejected draft's row and the real row
    of its slot among them — and writes them before the next draft."""
    window = 6
    prompts = [*_prompts(3, 7), torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(8)).tolist()]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    reference, _ = _generate(tiny_dir, prompts, params)
    full = {tuple(p): p + r for p, r in zip(prompts, reference, strict=True)}
    llm = _llm(tiny_dir, _spec(dspark_context_window=window), max_num_batched_tokens=24)
    scratch = _llm(tiny_dir)
    drafter = _dspark(llm)
    layers = llm.engine.model.captured_layers
    propose, gen, checked, waited = drafter.propose, torch.Generator().manual_seed(9), [0], [0]

    def checking(inputs):
        batch = inputs.last_tokens.shape[0]
        if pauses and batch and bool(torch.rand((), generator=gen) < 0.5):
            propose(dataclasses.replace(inputs, last_tokens=inputs.last_tokens[:0], positions=inputs.positions[:0],
                                        seeds=inputs.seeds[:0], temperature=inputs.temperature[:0]))
            waited[0] = max(waited[0], len(drafter.pending))
            return DraftProposal(torch.full((batch, inputs.k), -1), None, torch.zeros(batch, inputs.k))
        proposal = propose(inputs)
        if batch == 0:
            return proposal
        checked[0] += batch

        def features_of(tokens: list[int]) -> torch.Tensor:
            return scratch.teacher_force([tokens], top_k=1, layers=layers)[0].features

        return check_window_and_plant(drafter, inputs, proposal, features_of, full, window, gen, VOCAB)

    drafter.propose = checking
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.get_stats()
    assert checked[0] > 10 and stats["spec_decode"]["mean_acceptance_length"] > 1.5
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert waited[0] > 1 if pauses else waited[0] == 0


def test_drafts_have_the_right_shapes_and_confidences_in_the_open_unit_interval(llama_dir):
    llm = _llm(llama_dir, _spec("varlen", dspark_target_layer_ids=[0, 2]))
    proposals = _record(llm)
    params = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0.9, max_tokens=8, seed=5),
              SamplingParams(temperature=0, max_tokens=8)]
    llm.generate(_prompts(3, 2), params, use_tqdm=False)
    assert llm.engine.runner.hidden_layers == (0, 2)
    assert proposals
    for p in proposals:
        batch = p.tokens.shape[0]
        assert p.tokens.shape == (batch, K) and p.tokens.dtype == torch.int64
        assert bool(((p.tokens >= 0) & (p.tokens < VOCAB)).all())
        assert p.confidence.shape == (batch, K) and p.confidence.dtype == torch.float32
        assert bool(((p.confidence > 0) & (p.confidence < 1)).all())
    sampled = [p for p in proposals if p.probs is not None]
    assert sampled  # the sampling request makes the drafter report its distributions
    for p in sampled:
        assert p.probs.shape == (p.tokens.shape[0], K, VOCAB)
        assert torch.allclose(p.probs.sum(-1), torch.ones(p.tokens.shape[0], K), atol=1e-4)
        assert bool((p.probs.gather(-1, p.tokens.unsqueeze(-1)) > 0).all())  # drafts drawn from them


def test_weights_round_trip_through_the_safetensors_layout(llama_dir, tmp_path):
    prompts = _prompts(4, 3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def drafts(**kw) -> tuple[list[list[int]], list[DraftProposal], LLM]:
        llm = _llm(llama_dir, _spec(**kw.pop("spec", {})), **kw)
        proposals = _record(llm)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return out, proposals, llm

    out_a, saved, llm_a = drafts(seed=0)
    path = tmp_path / "dspark.safetensors"
    save_weights(_dspark(llm_a).network, path)
    out_b, loaded, _ = drafts(seed=7, spec={"dspark_weights": str(path)})
    _, fresh, _ = drafts(seed=7)
    assert out_a == out_b and len(saved) == len(loaded)
    for a, b in zip(saved, loaded, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.confidence, b.confidence)
    assert any(not torch.equal(a.confidence, c.confidence) for a, c in zip(saved, fresh, strict=True))
    with pytest.raises(ConfigError, match="dspark_weights"):  # a file for another shape is refused
        _llm(llama_dir, _spec(dspark_weights=str(path), dspark_markov_rank=8))
    # A file without ctx_kv (drafters trained before the context window): the context rows' keys and values
    # come from the layer's attn_norm and qkv, and it loads and drafts losslessly.
    state = {n: t for n, t in load_file(str(path)).items() if ".ctx_kv." not in n}
    old = tmp_path / "shared.safetensors"
    save_file(state, str(old))
    out_c, shared, llm_c = drafts(seed=7, spec={"dspark_weights": str(old), "dspark_context_window": 1})
    network = _dspark(llm_c).network
    assert out_c == out_a and shared and all(layer.ctx_kv is None for layer in network.layers)
    c = torch.randn(3, network.main_norm.weight.shape[0])
    layer = network.layers[0]
    _, k, v = layer.qkv(layer.attn_norm(c)).chunk(3, dim=-1)
    kv = layer.context_kv(c, torch.zeros(3, dtype=torch.long))  # position 0: RoPE leaves the keys as they are
    torch.testing.assert_close(kv[:, 0], k)
    torch.testing.assert_close(kv[:, 1], v)


def _hand_made_network(draft_vocab_size: int | None = None) -> DSparkNetwork:
    return DSparkNetwork(2, 1, 4, num_layers=1, heads=1, intermediate=4, markov_rank=2, dtype=torch.float32,
                         device=torch.device("cpu"), draft_vocab_size=draft_vocab_size)


def test_markov_correction_and_confidence_head_on_a_hand_made_block():
    network = _hand_made_network()
    markov, head = network.markov_head, network.confidence_head
    with torch.no_grad():
        # e(0) = [1, 0], e(1) = [0, 1], e(2) = [0, 0], e(3) = [1, 1]; correction adds 3·e₀ to token 2, 5·e₁ to token 3.
        markov.embed.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]]))
        markov.head.weight.copy_(torch.tensor([[0.0, 0.0], [0.0, 0.0], [3.0, 0.0], [0.0, 5.0]]))
        head.proj.weight.copy_(torch.tensor([[0.5, -1.0, 2.0, 1.0]]))
        head.proj.bias.fill_(0.25)
    logits = torch.tensor([[[2.0, 1.0, 0.0, 0.0],    # golden 0 → +[0,0,3,0]: 2 (uncorrected: 0)
                            [0.0, 4.0, 0.0, 0.0],    # previous draft 2 → no change: 1
                            [6.0, 0.0, 0.0, 2.0]]])  # previous draft 1 → +[0,0,0,5]: 3 (from the golden: 0)
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]])
    temps = torch.tensor([1.0, 0.5, 0.1])
    zero = torch.zeros(1, dtype=torch.int64)
    tokens, probs, confidence = draft_block(logits, hidden, zero, network, temps, torch.zeros(1), zero,
                                            torch.tensor([10]), report_probs=True)
    assert tokens.tolist() == [[2, 1, 3]]
    # z = w·[h, e] + b: 0.5 + 2 + 0.25 = 2.75 (T 1); −1 + 0.25 = −0.75 (T 0.5); −1 + 1 + 0.25 = 0.25 (T 0.1)
    expected = [1 / (1 + math.exp(-2.75)), 1 / (1 + math.exp(1.5)), 1 / (1 + math.exp(-2.5))]
    assert confidence[0].tolist() == pytest.approx(expected, rel=1e-5)
    assert probs is not None and probs[0].argmax(-1).tolist() == [2, 1, 3] and probs.max() == 1.0  # greedy: one-hot


def test_greedy_identity_survives_preemption_and_aborts(tmp_path):
    folder = save_tiny("llama", tmp_path / "m")[1]
    prompts = _prompts(10, 4)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for _ in range(10)]
    reference, _ = _generate(folder, prompts, params, max_model_len=128)
    # 13 blocks: the main cache's 2 layers × K, V × 16 tokens × 2 heads × 16 floats and as many bytes of the
    # drafter's context rows (1 layer × K, V × 16 tokens × 64 floats), which the budget counts.
    out, llm = _generate(folder, prompts, params, _spec("fixed"), kv_cache_bytes=13 * 2 * (2 * 2 * 16 * 2 * 16 * 4),
                         max_model_len=128)
    assert out == reference
    assert_preempted_then_aborts_free_every_block(llm, prompts, params)


def test_config_checks_and_the_reference_temperature_knob(llama_dir, monkeypatch):
    assert SpecDecodeConfig(max_draft=3, dspark_confidence_temperature="1.0,0.5,0.25").dspark_confidence_temperature \
        == [1.0, 0.5, 0.25]
    with pytest.raises(ValueError, match="one per draft"):
        SpecDecodeConfig(max_draft=4, dspark_confidence_temperature=[1.0, 0.5])
    with pytest.raises(ConfigError, match="dspark_target_layer_ids"):
        _llm(llama_dir, _spec(dspark_target_layer_ids=[1, 3]))  # the model has 2 layers
    monkeypatch.setenv("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE", ",".join(["0.5"] * K))
    llm = _llm(llama_dir, _spec())
    assert _dspark(llm).confidence_temperature.tolist() == [0.5] * K


def test_a_bfloat16_drafter_beside_a_float32_target(llama_dir):
    """``dspark_dtype: bfloat16``: the drafter's weights, head and context cache in bf16 (counted so in the KV
    budget) under a float32 target, whose verification keeps the greedy tokens of no speculation."""
    prompts = _prompts(4, 3)
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)] * 4
    reference, _ = _generate(llama_dir, prompts, params)
    out, llm = _generate(llama_dir, prompts, params, _spec("varlen", dspark_dtype="bfloat16"))
    assert out == reference
    drafter = _dspark(llm)
    assert llm.engine.model.embed_tokens.weight.dtype == torch.float32
    assert {p.dtype for p in drafter.network.parameters()} == {torch.bfloat16}
    assert drafter.context.dtype == drafter.head.dtype == torch.bfloat16
    assert context_bytes_per_slot(llm.engine.model, SpecDecodeConfig(drafter="dspark", dspark_dtype="bfloat16")) \
        == drafter.context[0].numel() * 2
    assert llm.get_stats()["spec_decode"]["verify_steps"] > 0
    with pytest.raises(ValueError, match="dspark_dtype"):
        SpecDecodeConfig(dspark_dtype="int8")


def test_auto_weights_need_a_tokenizer(llama_dir):
    with pytest.raises(ConfigError, match="needs its tokenizer"):
        _llm(llama_dir, _spec(dspark_weights="auto"))


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_tensor_bytes(v) for v in value) if isinstance(value, tuple | list) else 0


def test_the_context_cache_is_counted_in_the_kv_budget(llama_dir):
    budget = 1 << 20
    plain = _llm(llama_dir, {"spec_decode": {"enabled": True, "drafter": "ngram", "max_draft": K}},
                 kv_cache_bytes=budget)
    llm = _llm(llama_dir, _spec(dspark_num_layers=2), kv_cache_bytes=budget)
    drafter, pool = _dspark(llm), llm.engine.pool
    main_bytes = _tensor_bytes(pool.layers)
    per_block = main_bytes // pool.num_blocks
    assert _tensor_bytes(plain.engine.pool.layers) == plain.engine.pool.num_blocks * per_block
    slots = pool.num_blocks * pool.block_size
    hidden = llm.engine.model.embed_tokens.weight.shape[1]
    assert drafter.context.shape == (slots, 2, 2, hidden)
    # The pool shrank by the drafter's rows: both fit the budget, and one more block would not.
    total = main_bytes + _tensor_bytes(drafter.context)
    assert total <= budget < total + per_block + _tensor_bytes(drafter.context) // pool.num_blocks
    assert pool.num_blocks < plain.engine.pool.num_blocks
