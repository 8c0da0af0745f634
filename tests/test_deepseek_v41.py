"""DeepSeek-V4.1-Flash (``DeepseekV41ForCausalLM``) on tiny random configs, fp32 on CPU. No transformers
oracle exists for V4.1: with every V4.1 feature off it must equal the V4 model; each feature is checked
against a statement of its definition written here from the reference; and cached, chunked generation
must equal a from-scratch forward at every step."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from test_deepseek_v4 import BLOCK, VOCAB, make_llm, prompts, request_ctx
from tiny_models import assert_cached_logits_match, randomize, record_logits

from deepinfer import SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.kv.pools import bytes_per_block
from deepinfer.model.deepseek_v4 import engram, hyper, v41_attention, v41_indexer
from deepinfer.model.deepseek_v4.v41 import DeepseekV41ForCausalLM
from deepinfer.model.deepseek_v4.v41_config import CandidateLimit, V41Dims
from deepinfer.ops import TorchSinkAttentionBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
# 8 indexer heads: with fewer, relu zeroes every head of some entries and exact-zero scores tie at the top-k cut.
TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 5,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8,
        "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 6, "hc_mult": 2,
        "hc_sinkhorn_iters": 5, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
        "topk_method": "noaux_tc", "sliding_window": 8, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": YARN, "max_position_embeddings": 512, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "swiglu_limit": 10.0, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        # layer 0 sliding, 1 C2, 2 the first C1 (first YoCo consumer), 3 C1 sharing layer 2's KV, index keys
        # and top-k, 4 C1 on its own
        "compress_ratios": [0, 2, 1, 1, 1], "kv_source_layer_ids": [0, 1, 2, 4],
        "index_source_layer_ids": [0, 1, 2, 4], "hc_shifted": True,
        "candidate_source_layer_id": 1, "candidate_topk_blocks": 2, "candidate_block_size": 2}
# Every V4.1 feature off: no shifted HC, every layer its own source, no candidate limit, and a top-k that
# holds every entry (then C1 layers see every complete entry, as V4's ratio-1 HCA layers).
OFF = {"hc_shifted": False, "compress_ratios": [0, 0, 1, 1, 1], "kv_source_layer_ids": [0, 1, 2, 3, 4],
       "index_source_layer_ids": [0, 1, 2, 3, 4], "candidate_source_layer_id": None, "index_topk": 512}


# Engram on both YoCo producers: 3-grams, 2 heads of 8 per order, tables of primes above 49.
ENGRAM = {"engram_layer_ids": [0, 1], "engram_max_ngram_size": 3, "engram_vocab_size": 50, "engram_n_heads": 2,
          "engram_head_dim": 8, "engram_pad_token_id": 2}


def v41_config(**text: object) -> dict:
    body = {k: v for k, v in {**TEXT, **text}.items() if v is not None}
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "bos_token_id": 0,
            "eos_token_id": 1, "pad_token_id": 2, "dtype": "float32", "text_config": body}


def reference_tensors(model: DeepseekV41ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under the reference's tensor names (``hugging_face/names.py``), written out
    name by name as the reference's checkpoint holds them."""
    d, out = model.d, {}
    out["embed.weight"] = model.embed_tokens.weight
    out["head.weight"] = model.lm_head
    out["norm.weight"] = model.norm.weight
    if model.hc_head is not None:
        out.update({"hc_head_fn": model.hc_head.fn, "hc_head_base": model.hc_head.base,
                    "hc_head_scale": model.hc_head.scale})
    for i, layer in enumerate(model.layers):
        p, attn, mlp = f"layers.{i}.", layer.self_attn, layer.mlp
        for site, hc in (("attn", layer.attn_hc), ("ffn", layer.ffn_hc)):
            out.update({f"{p}hc_{site}_fn": hc.fn, f"{p}hc_{site}_base": hc.base, f"{p}hc_{site}_scale": hc.scale})
        out[p + "attn.wq_a.weight"] = attn.qkv_a_weight[: d.q_lora]
        out[p + "attn.wkv.weight"] = attn.qkv_a_weight[d.q_lora:]
        out.update({p + "attn.q_norm.weight": attn.q_a_norm.weight, p + "attn.wq_b.weight": attn.q_b_weight,
                    p + "attn.kv_norm.weight": attn.kv_norm.weight, p + "attn.wo_a.weight": attn.o_a_weight,
                    p + "attn.wo_b.weight": attn.o_b_weight, p + "attn.attn_sink": attn.sinks,
                    p + "attn_norm.weight": layer.input_layernorm.weight,
                    p + "ffn_norm.weight": layer.post_attention_layernorm.weight,
                    p + "ffn.gate.weight": mlp.gate_weight, p + "ffn.gate.bias": mlp.e_score_correction_bias})
        if attn.compressor is not None:
            comp = attn.compressor
            kv, *gate = comp.kv_gate_weight.chunk(2 if comp.gated else 1)
            out[p + "attn.compressor.wkv.weight"] = kv
            if gate:
                out[p + "attn.compressor.wgate.weight"] = gate[0]
            out[p + "attn.compressor.norm.weight"] = comp.norm.weight
        if attn.index_keys is not None:
            out[p + "attn.indexer.wk.weight"] = attn.index_keys.wk_weight
            out[p + "attn.indexer.k_norm.weight"] = attn.index_keys.k_norm.weight
        if attn.index_query is not None:
            out[p + "attn.indexer.wq_b.weight"] = attn.index_query.q_b_weight
            out[p + "attn.indexer.weights_proj.weight"] = attn.index_query.weights_weight
        if (eg := layer.engram) is not None:
            out.update({p + "engram.q_weight": eg.q_weight, p + "engram.k_weight": eg.k_weight,
                        p + "engram.wkv.weight": eg.wkv_weight, p + "engram.embed.weight": eg.table})
        gate_up, down = mlp.shared_gate_up.chunk(2), mlp.shared_down
        out.update({p + "ffn.shared_experts.w1.weight": gate_up[0], p + "ffn.shared_experts.w3.weight": gate_up[1],
                    p + "ffn.shared_experts.w2.weight": down})
        for e in range(d.n_routed):
            w1, w3 = mlp.w13[e].chunk(2)
            out.update({f"{p}ffn.experts.{e}.w1.weight": w1, f"{p}ffn.experts.{e}.w3.weight": w3,
                        f"{p}ffn.experts.{e}.w2.weight": mlp.w2[e]})
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def build_v41(folder: Path, seed: int = 0, **text: object) -> DeepseekV41ForCausalLM:
    """A random tiny V4.1 model saved to ``folder`` under the reference's names and config keys."""
    config = v41_config(**text)
    model = DeepseekV41ForCausalLM(config, dtype=torch.float32, device=torch.device("cpu"), max_positions=512)
    gen = torch.Generator().manual_seed(seed)
    randomize(model, gen)
    for layer in model.layers:
        if layer.engram is not None:  # 3 padding rows past the primes, as a sharded table may have
            layer.engram.set_table(torch.randn(layer.engram.rows + 3, layer.engram.head_dim, generator=gen))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(reference_tensors(model), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return model


def v4_folder_of(v41: Path, folder: Path) -> None:
    """The V4 (upstream layout) twin of a features-off V4.1 folder: ratio-1 layers become V4 HCA layers
    of ratio 1 (a gate, whose single-slot softmax is 1, and a zero position bias), ``attn.kv_norm`` is
    V4's ``attn.norm``, and the indexer (which picks every entry) goes."""
    from safetensors.torch import load_file

    text = json.loads((v41 / "config.json").read_text())["text_config"]
    tensors = {}
    for name, t in load_file(str(v41 / "model.safetensors")).items():
        if ".attn.indexer." in name:
            continue
        name = name.replace("attn.kv_norm.weight", "attn.norm.weight")
        tensors[name] = t
        if name.endswith("attn.compressor.wkv.weight"):
            tensors[name.replace("wkv", "wgate")] = torch.randn_like(t)
            tensors[name.replace("wkv.weight", "ape")] = torch.zeros(1, t.shape[0])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {k: v for k, v in text.items() if k not in (
        "kv_source_layer_ids", "index_source_layer_ids", "hc_shifted", "norm_topk_prob", "topk_method")}
    config.update({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_hash_layers": 0,
                   "yoco_num_producer_layers": text["compress_ratios"].index(1), "bos_token_id": 0,
                   "eos_token_id": 1})
    (folder / "config.json").write_text(json.dumps(config))


MIXED = prompts([5, 23, 40, 17], seed=1)


def v41_llm(folder: Path, **kw: object):
    """``make_llm`` with a short ``max_model_len`` (the tiny cache holds 256 tokens a request, not the
    512 of ``text_config.max_position_embeddings``)."""
    return make_llm(folder, max_model_len=256, **kw)


def _logits_by_request(llm, batch: list[list[int]], max_new: int) -> list[torch.Tensor]:
    steps = record_logits(llm)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True), use_tqdm=False)
    rows: dict[str, list[torch.Tensor]] = {}
    for ids, logits in steps:
        for rid, row in zip(ids, logits, strict=True):
            rows.setdefault(rid, []).append(row)
    return [torch.stack(rows[o.request_id]) for o in outs]


def test_features_off_equals_v4(tmp_path):
    """With hc_shifted off, every layer its own source, no candidate limit, a top-k holding every entry
    and V4's per-head query norm put back, V4.1 gives the V4 model's logits (its C1 layers are V4's
    ratio-1 HCA layers); without that norm they differ (the reference's V4.1 has none)."""
    build_v41(tmp_path / "v41", **OFF)
    v4_folder_of(tmp_path / "v41", tmp_path / "v4")
    llm = v41_llm(tmp_path / "v41", max_num_batched_tokens=32)
    for layer in llm.engine.model.layers:  # V4's per-head query norm, which the reference's V4.1 drops
        layer.self_attn.q_norm = True
    ours = _logits_by_request(llm, MIXED, 12)
    theirs = _logits_by_request(make_llm(tmp_path / "v4", max_model_len=256, max_num_batched_tokens=32), MIXED, 12)
    for a, b in zip(ours, theirs, strict=True):
        assert (a - b).abs().max().item() <= 1e-6 * b.abs().max().item()
    plain = _logits_by_request(v41_llm(tmp_path / "v41", max_num_batched_tokens=32), MIXED, 12)
    assert not torch.allclose(plain[0], theirs[0], rtol=1e-3, atol=1e-3)


class FromScratch:
    """The oracle of ``assert_cached_logits_match``: one forward over the whole sequence on a fresh cache
    (zeroed; ``overrides`` go to ``v41_llm``, e.g. the cache's ``kv_dtype``)."""

    def __init__(self, folder: Path, **overrides) -> None:
        self.llm = v41_llm(folder, **overrides)

    def __call__(self, full: torch.Tensor) -> SimpleNamespace:
        engine = self.llm.engine
        model, ids = engine.model, full[0]
        for cache in engine.pool.layers:
            for t in cache:
                t.zero_()
        table = list(range(1, 2 + len(ids) // BLOCK))
        ctx = request_ctx(engine.runner.backends, 0, len(ids), table, slot=1)
        with torch.inference_mode():
            return SimpleNamespace(logits=model.compute_logits(model.forward(ids, ctx), ctx).unsqueeze(0))


@pytest.mark.parametrize("features", ["all", "no-shift", "engram"])
def test_prefill_and_cached_decode_equal_from_scratch(tmp_path, features):
    """Every V4.1 feature on (shifted HC, KV/index/top-k sharing, the candidate limit; Engram too):
    chunked prefill and 32 cached decode steps give, at every step, the logits of one forward over the
    whole sequence (so Engram's n-gram ring feeds decode steps what the sequence holds)."""
    build_v41(tmp_path, **{"all": {}, "no-shift": {"hc_shifted": False}, "engram": ENGRAM}[features])
    llm = v41_llm(tmp_path, max_num_batched_tokens=32)
    assert_cached_logits_match(llm, FromScratch(tmp_path), prompts([5, 23, 40], seed=3), 32)


def test_cache_specs_allocate_only_source_layers(tmp_path):
    """Layer 3 reads layer 2's entries and indexer keys: its spec has no paged part, the pool's bytes
    per block count only the sources, and bound layer 3 aliases layer 2's tensors. An Engram layer's
    window (the replay planners' reach back) counts its n-grams' n − 1 earlier tokens."""
    build_v41(tmp_path)
    llm = v41_llm(tmp_path)
    model = llm.engine.model
    specs = model.cache_specs()
    assert [len(s.paged) for s in specs] == [0, 2, 2, 0, 2]
    assert [len(s.rings) for s in specs] == [1, 2, 2, 1, 2]
    d = model.d
    entries = sum(BLOCK // r * (d.head_dim + d.index_dim) for r in (2, 1, 1))
    assert bytes_per_block(specs, BLOCK, torch.float32) == entries * 4
    a2, a3 = model.layers[2].self_attn, model.layers[3].self_attn
    assert a3.kv_paged is a2.kv_paged and a3.index_paged is a2.index_paged
    assert a3.compressor is None and a3.index_query is None
    assert [s.window for s in specs] == [8] * 5
    engram_specs = DeepseekV41ForCausalLM(v41_config(**ENGRAM), dtype=torch.float32, device=torch.device("cpu"),
                                          max_positions=64).cache_specs()
    assert [s.window for s in engram_specs] == [10, 10, 8, 8, 8]  # Engram layers reach 2 more tokens back


@pytest.mark.parametrize("index_k", ["shared", "own"])
def test_cross_layer_sharing_equals_recomputing_with_tied_weights(tmp_path, index_k):
    """Layer 3 reads layer 2's entries (both YoCo consumers, so both compressors read the shared hidden),
    and its index keys too (``shared``) or projects its own keys of them (``own``: an index-K source inside
    layer 2's KV segment): the logits of a model where layer 3 computes everything itself from tied weights.
    Its cache spec holds only what it owns."""
    maps = {"index_source_layer_ids": [0, 1, 2, 3, 4],
            "index_k_source_layer_ids": [0, 1, 2, 4] if index_k == "shared" else [0, 1, 2, 3, 4]}
    shared = build_v41(tmp_path / "shared", **maps)
    tensors = reference_tensors(shared)
    tied = ["attn.compressor.wkv.weight", "attn.compressor.norm.weight"]
    if index_k == "shared":
        tied += ["attn.indexer.wk.weight", "attn.indexer.k_norm.weight"]
    for leaf in tied:
        tensors[f"layers.3.{leaf}"] = tensors[f"layers.2.{leaf}"].clone()
    own = tmp_path / "own"
    own.mkdir()
    save_file(tensors, str(own / "model.safetensors"))
    (own / "config.json").write_text(json.dumps(v41_config(index_source_layer_ids=[0, 1, 2, 3, 4],
                                                           index_k_source_layer_ids=[0, 1, 2, 3, 4],
                                                           kv_source_layer_ids=[0, 1, 2, 3, 4])))
    llm = v41_llm(tmp_path / "shared", max_num_batched_tokens=32)
    assert len(llm.engine.model.cache_specs()[3].paged) == (0 if index_k == "shared" else 1)
    a = _logits_by_request(llm, MIXED, 8)
    b = _logits_by_request(v41_llm(own, max_num_batched_tokens=32), MIXED, 8)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_top_k_consumer_reuses_the_source_top_k(tmp_path, monkeypatch):
    """Layer 3 scores nothing: the entries it attends to are the very tensor layer 2 selected."""
    build_v41(tmp_path)
    llm = v41_llm(tmp_path)
    seen: list[tuple[int, torch.Tensor | None]] = []
    backend = llm.engine.runner.backends["sink_attention"]
    attend = backend.sink_attention

    def spy(*args, **kw):
        seen.append(kw.get("selected"))
        return attend(*args, **kw)

    monkeypatch.setattr(backend, "sink_attention", spy)
    calls = []
    real = v41_indexer.select
    monkeypatch.setattr(v41_attention, "select", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    llm.generate([prompts([20], seed=5)[0]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert len(calls) == 3  # layers 1, 2 and 4
    assert seen[0] is None and seen[3] is seen[2] and seen[4] is not seen[2]


def _float64_scores(q, w, keys, positions, ratio, scale):
    """``scale · Σ_h w_h · relu(q_h · k_e)`` in float64, −inf for entries not complete at the query."""
    s = torch.einsum("nhd,cd->nhc", q.double(), keys.double()).relu() * scale
    s = (s * w.double().unsqueeze(-1)).sum(1)
    complete = ((positions + 1) // ratio).unsqueeze(1)
    return s.masked_fill(torch.arange(keys.shape[0]) >= complete, float("-inf"))


@pytest.mark.parametrize("ratio", [1, 2])
def test_candidate_limit_equals_full_scoring_restricted_to_the_candidates(ratio):
    """The candidate source's blocks are its best-scoring blocks (the last complete one forced in); a
    limited layer's top-k equals full float64 scoring with every entry outside those blocks removed."""
    gen = torch.Generator().manual_seed(7)
    rows, heads, dim, count, per_block = 5, 3, 8, 40, 4
    limit = CandidateLimit(source=0, topk_blocks=3, block_size=per_block, block_tokens=per_block * ratio)
    q, w = torch.randn(rows, heads, dim, generator=gen), torch.randn(rows, heads, generator=gen)
    keys = torch.randn(count, dim, generator=gen)
    paged = keys.view(1, count, dim)  # one block holding every entry
    positions = torch.tensor([3, 17, 40, 55, 79]) if ratio == 2 else torch.tensor([3, 17, 20, 30, 39])
    # one request of 5 query rows whose 40 entries fill the block table's width; the reference backend's scores
    ctx = SimpleNamespace(block_tables=torch.tensor([[0]]), positions=positions, query_start_loc_host=[0, rows],
                          seq_lens_host=[count * ratio])
    scores = TorchSinkAttentionBackend().indexer_scores(q, w, paged, ctx, ratio=ratio, scale=0.25)
    ref = _float64_scores(q, w, keys, positions, ratio, 0.25)
    assert torch.allclose(scores.double(), ref, rtol=1e-5, atol=1e-6)
    blocks = v41_indexer.candidate_blocks(scores, limit)
    for r in range(rows):
        complete = int((positions[r] + 1) // ratio)
        valid = -(-complete // per_block)
        block_best = [ref[r, b * per_block:(b + 1) * per_block].max().item() for b in range(valid)]
        if valid:
            block_best[valid - 1] = float("inf")
        want = sorted(range(valid), key=lambda b: -block_best[b])[: limit.topk_blocks]
        got = [b for b in blocks[r].tolist() if b >= 0]
        assert sorted(got) == sorted(want)
        assert blocks[r].tolist().count(-1) == limit.topk_blocks - len(want)
    entries_per_block = limit.block_tokens // ratio
    limited = v41_indexer.top_entries(v41_indexer.restrict_to_candidates(scores, blocks, entries_per_block), 4)
    for r in range(rows):
        allowed = {e for b in blocks[r].tolist() if b >= 0
                   for e in range(b * entries_per_block, (b + 1) * entries_per_block)}
        kept = sorted((ref[r, e].item() for e in allowed if e < count and ref[r, e] > float("-inf")), reverse=True)
        got = [e for e in limited[r].tolist() if e >= 0]
        assert set(got) <= allowed  # relu ties (exact zeros) may pick either entry: compare the scores
        assert [ref[r, e].item() for e in got] == pytest.approx(kept[:4], rel=1e-5, abs=1e-6)


def test_shifted_hyper_connections_on_hand_made_streams():
    """hc_shifted: a sub-layer reads the streams through the pre-mix the sub-layer before computed (the
    first through stream 0), and the last pre-mix folds the final streams. Float64 restatement of three
    sub-layers (x → tanh(x·A)) against the model's ``mixes``/``collapse``/``write_back``."""
    d = V41Dims(v41_config())
    gen = torch.Generator().manual_seed(3)
    sites = [hyper.HyperConnection(d) for _ in range(3)]
    for hc in sites:
        randomize(hc, gen)
    maps = [torch.randn(d.hidden, d.hidden, generator=gen) * 0.2 for _ in range(3)]
    streams = torch.randn(4, d.hc_mult, d.hidden, generator=gen)

    def ref_mixes(hc, s):
        m = d.hc_mult
        flat = s.flatten(1)
        flat = flat / torch.sqrt(flat.square().mean(-1, keepdim=True) + d.eps)
        mix = flat @ hc.fn.double().T
        sc, b = hc.scale.double(), hc.base.double()
        pre = torch.sigmoid(mix[:, :m] * sc[0] + b[:m]) + d.hc_eps
        post = 2 * torch.sigmoid(mix[:, m:2 * m] * sc[1] + b[m:2 * m])
        comb = torch.softmax((mix[:, 2 * m:] * sc[2] + b[2 * m:]).view(-1, m, m), -1) + d.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + d.hc_eps)
        for _ in range(d.hc_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + d.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + d.hc_eps)
        return pre, post, comb

    s_ref, s = streams.double(), streams
    pre_ref = torch.zeros(4, d.hc_mult, dtype=torch.float64)
    pre_ref[:, 0] = 1
    pre = pre_ref.float()
    for hc, a in zip(sites, maps, strict=True):
        p, post, comb = ref_mixes(hc, s_ref)
        y = torch.tanh((pre_ref.unsqueeze(-1) * s_ref).sum(1) @ a.double())
        s_ref = post.unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("tjk,tjh->tkh", comb, s_ref)
        pre_ref = p
        p, post32, comb32 = hc.mixes(s)
        y32 = torch.tanh(hyper.HyperConnection.collapse(pre, s) @ a)
        s, pre = hyper.HyperConnection.write_back(post32, comb32, y32, s), p
    final_ref = (pre_ref.unsqueeze(-1) * s_ref).sum(1)
    assert torch.allclose(hyper.HyperConnection.collapse(pre, s).double(), final_ref, rtol=1e-4, atol=1e-5)


def test_missing_or_extra_tensor_fails_naming_it(tmp_path):
    """A checkpoint under the reference's names loads; one tensor less, or one more, fails naming it."""
    model = build_v41(tmp_path / "ok")
    v41_llm(tmp_path / "ok")
    tensors = reference_tensors(model)
    config = json.dumps(v41_config())
    for case, change in (("missing", lambda t: t.pop("layers.4.attn.indexer.wk.weight")),
                         ("extra", lambda t: t.update({"layers.3.attn.indexer.wk.weight": torch.zeros(16, 32)}))):
        folder = tmp_path / case
        folder.mkdir()
        broken = dict(tensors)
        change(broken)
        save_file(broken, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(config)
        name = ("layers.4.self_attn.index_keys.wk_weight" if case == "missing"
                else "layers.3.attn.indexer.wk.weight")
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            v41_llm(folder)


def test_dspark_tensors_are_skipped_with_a_warning(tmp_path, caplog):
    """``mtp.*`` (DSpark) tensors do not load yet: the model says so and runs without them."""
    model = build_v41(tmp_path)
    tensors = {**reference_tensors(model), "mtp.0.main_proj.weight": torch.zeros(64, 128)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.WARNING):
        v41_llm(tmp_path)
    assert "DSpark" in caplog.text


@pytest.mark.parametrize(("change", "key"), [
    ({**ENGRAM, "engram_layer_ids": [3]}, "engram_layer_ids"),
    ({"some_new_key": 1}, "some_new_key"),
    ({"compress_ratios": [0, 4, 1, 1, 1]}, "compress_ratios"),
    ({"kv_source_layer_ids": [0, 1, 2, 3, 4], "index_k_source_layer_ids": [0, 1, 2, 4]}, "index_k_source_layer_ids"),
    ({"kv_source_layer_ids": [0, 2, 4]}, "kv_source_layer_ids"),
])
def test_unsupported_config_is_an_error_naming_the_key(change, key):
    with pytest.raises(ConfigError, match=key):
        V41Dims(v41_config(**change))


def test_engram_rows_and_gate_follow_the_definition():
    """Hand-made n-grams: each order's xor of ``c_r · m_r`` modulo each head's prime plus its offset; the
    gate in float64: ``x_k + sigmoid(ssqrt(⟨rms(x_k)·q_k, rms(k_k)·k'_k⟩ / sqrt(H))) · v``."""
    primes = engram.table_primes([4], 2, 2, 50)[4]
    mult = engram.hash_multipliers(4, 3, VOCAB)
    flat = [p for order in primes for p in order]
    offsets = torch.tensor([0, *flat[:-1]]).cumsum(0)
    grams = torch.tensor([[5, 2, 2], [7, 5, 2], [9, 7, 5], [200, 9, 7]])
    rows = engram.engram_rows(grams, mult, torch.tensor(primes), offsets)
    m = [int(x) for x in mult]
    for t_, (c0, c1, c2) in enumerate(grams.tolist()):
        h2 = (c0 * m[0]) ^ (c1 * m[1])
        h3 = h2 ^ (c2 * m[2])
        want = [h2 % primes[0][0], h2 % primes[0][1] + flat[0], h3 % primes[1][0] + sum(flat[:2]),
                h3 % primes[1][1] + sum(flat[:3])]
        assert rows[t_].tolist() == want
    gen = torch.Generator().manual_seed(2)
    x, kv = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 3, 16, generator=gen)
    q, k = torch.randn(2, 16, generator=gen), torch.randn(2, 16, generator=gen)
    out = engram.engram_gate(x, kv, q, k, 1e-6).double()
    xd, kd = x.double(), kv[:, :2].double()
    xn = xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + 1e-6)
    kn = kd / torch.sqrt(kd.square().mean(-1, keepdim=True) + 1e-6)
    dot = (xn * q.double() * kn * k.double()).sum(-1) / 4.0
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=1e-6).sqrt())
    assert torch.allclose(out, xd + gate.unsqueeze(-1) * kv[:, 2:].double(), rtol=1e-5, atol=1e-5)


def test_engram_ngrams_on_device_equal_the_per_request_path():
    """Two requests (slots 1 and 3) through a prompt step, then verification-sized steps that roll back
    drafts: ``ngrams_on_device`` (positions and slots only) gives the per-request path's n-grams, with a
    sentinel (an id past the lookup) cutting the longer orders."""
    from deepinfer.model.deepseek_v4.rows import _Segment

    lookup = torch.arange(40) % 17
    n, backtrack = 3, 2
    host, device = engram.NgramHistory(n, 2, lookup), engram.NgramHistory(n, 2, lookup)
    host.bind(4, backtrack, torch.device("cpu"))
    device.bind(4, backtrack, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    lengths = {1: 0, 3: 0}
    prompt = {1: 5, 3: 2}  # the first step: prompts through the per-request path on both
    ids = torch.randint(0, 40, (7,), generator=gen)
    segments = [_Segment(0, 5, 0, 5, 1, 0, 0), _Segment(5, 7, 0, 2, 3, 0, 1)]
    assert torch.equal(host.ngrams(ids, segments), device.ngrams(ids, segments))
    lengths.update(prompt)
    for step in range(6):  # each request brings 1 + up to 2 drafts, then keeps a random prefix of them
        rows = {slot: int(torch.randint(1, backtrack + 2, (1,), generator=gen)) for slot in lengths}
        ids = torch.randint(0, 45 if step == 3 else 40, (sum(rows.values()),), generator=gen)
        segments, positions, slots, lo = [], [], [], 0
        for i, (slot, count) in enumerate(rows.items()):
            start = lengths[slot]
            segments.append(_Segment(lo, lo + count, start, start + count, slot, 0, i))
            positions += range(start, start + count)
            slots += [slot] * count
            lo += count
            lengths[slot] = start + int(torch.randint(1, count + 1, (1,), generator=gen))  # accepted
        want = host.ngrams(ids, segments)
        got = device.ngrams_on_device(ids, torch.tensor(positions), torch.tensor(slots))
        assert torch.equal(got, want), step


def test_engram_tables_are_distinct_primes_in_config_order():
    """Each head's table size is the next prime after the previous head's (from ``vocab − 1`` at each
    order), never one another layer/order/head already took; multipliers are odd and per layer."""
    sizes = engram.table_primes([0, 3], 2, 3, 20)
    assert sizes[0] == [[23, 29, 31], [37, 41, 43]]  # 23 after 19; 2nd order restarts at 19, skips those taken
    assert sizes[3] == [[47, 53, 59], [61, 67, 71]]
    a, b = engram.hash_multipliers(0, 3, 20), engram.hash_multipliers(3, 3, 20)
    assert (a % 2 == 1).all() and (b % 2 == 1).all() and not torch.equal(a, b)
    assert torch.equal(a, engram.hash_multipliers(0, 3, 20))


def _tokenizer_json(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<｜▁pad▁｜>": 2, "Hello": 3, "hello": 4, "héllo": 5, "  ": 6, "world": 7,
             "WORLD": 8, " ": 9}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def test_tokenizer_compression_merges_normalized_tokens(tmp_path):
    """Case, accents and whitespace runs fold together (``Hello``/``hello``/``héllo``; two spaces and one);
    special tokens keep their own ids; the PAD must be id 2."""
    _tokenizer_json(tmp_path)
    table, size = engram.compressed_vocabulary(tmp_path / "tokenizer.json")
    assert table == [0, 1, 2, 3, 3, 3, 4, 5, 5, 4] and size == 6


def test_engram_with_tokenizer_compression_loads_from_the_folder(tmp_path):
    """``engram_compressed_vocab_size`` makes the model read the folder's tokenizer.json (a wrong size is
    an error naming the key), its n-grams are compressed ids, and its tables are memory maps of the file."""
    model = build_v41(tmp_path, **ENGRAM, vocab_size=VOCAB)
    _tokenizer_json(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["engram_compressed_vocab_size"] = 7
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size"):
        v41_llm(tmp_path)
    config["text_config"]["engram_compressed_vocab_size"] = 6
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = reference_tensors(model)
    tensors["layers.0.engram.embed.weight"] = tensors["layers.0.engram.embed.weight"].bfloat16()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    llm = v41_llm(tmp_path)
    table = llm.engine.model.layers[0].engram.table
    # memory-mapped in the checkpoint's dtype (the loader would have cast it to the model's float32)
    assert table.dtype == torch.bfloat16 and torch.equal(table, tensors["layers.0.engram.embed.weight"])
    history = llm.engine.model.ngram_history
    assert history.lookup.tolist() == [0, 1, 2, 3, 3, 3, 4, 5, 5, 4] and history.pad == 2
    out = llm.generate([[3, 4, 5, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("features", ["all", "engram"])
def test_preemption_prefix_hits_and_aborts_leave_nothing_behind(tmp_path, features):
    """Every feature on (Engram too): a tight cache (preemptions), then a second wave of the same prompts,
    each twice (prefix hits, exact replay in 16-token chunks) with every third request aborted after one
    step. The requests that finish have the greedy ids of a roomy run, the aborted ones a prefix of them,
    and every block and state slot is back."""
    from test_deepseek_v4 import _blocks_budget

    build_v41(tmp_path, **({} if features == "all" else ENGRAM))
    batch = prompts([30, 17, 25, 8, 40, 22, 13, 35], seed=8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    roomy = [o.outputs[0].token_ids for o in v41_llm(tmp_path).generate(batch, params, use_tqdm=False)]
    budget = _blocks_budget(v41_llm(tmp_path), 16)
    llm = make_llm(tmp_path, cache={"kv_cache_bytes": budget}, max_model_len=96, max_num_batched_tokens=16)
    first = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert first == roomy
    assert llm.get_stats()["preemptions"] > 0
    engine = llm.engine
    hits_before = engine.kv.hit_tokens
    order = [i for i in range(len(batch)) for _ in range(2)]
    reqs = [engine.make_request(batch[i], params) for i in order]
    for req in reqs:
        engine.add(req)
    engine.step()
    aborted = reqs[0::3]
    for req in aborted:
        engine.abort(req.request_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.hit_tokens > hits_before
    for req, i in zip(reqs, order, strict=True):
        assert req.output_token_ids == roomy[i][:len(req.output_token_ids)]
        assert req.finish_reason == ("abort" if any(req is r for r in aborted) else "length")
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not engine.kv.slots and len(engine.kv.free_slots) == engine.num_state_slots - 1


def test_dummy_weights_generate(tmp_path):
    """``load_format=dummy`` (the shaped benchmark config's way): a V4.1 folder with only config.json runs,
    its context length read from ``text_config``."""
    (tmp_path / "config.json").write_text(json.dumps(v41_config(max_position_embeddings=192)))
    llm = make_llm(tmp_path, load_format="dummy")
    assert llm.engine.max_model_len == 192
    out = llm.generate([prompts([12], seed=4)[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_dummy_weights_with_engram_layers_generate_deterministically(tmp_path):
    """``load_format=dummy`` with Engram layers: each layer's table is computed from the row index
    (``HashedTable``, no memory), so a request's tokens are the same alone, in a batch and in a second engine."""
    (tmp_path / "config.json").write_text(json.dumps(v41_config(max_position_embeddings=192, **ENGRAM)))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    batch = prompts([12, 7, 20], seed=6)
    runs = []
    for _ in range(2):
        llm = make_llm(tmp_path, load_format="dummy")
        table = llm.engine.model.layers[0].engram.table
        rows = torch.tensor([0, 5, 5, 11])
        looked = table.index_select(0, rows)
        assert looked.shape == (4, ENGRAM["engram_head_dim"]) and torch.equal(looked[1], looked[2])
        assert not torch.equal(looked[0], looked[1]) and looked.abs().max() < 0.02 * 3 ** 0.5 + 1e-6
        runs.append([o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)])
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in batch]
        assert alone == runs[-1]
    assert runs[0] == runs[1]


def test_indexer_row_blocks_change_nothing(tmp_path, monkeypatch):
    """The indexer scores prefill rows in blocks bounded like the V4 reference op's (here 2–3 rows a
    block): the same greedy ids, logits within 1e-5 × max, as unblocked."""
    from deepinfer.model.layers import reference_deepseek_v4

    build_v41(tmp_path)
    whole = _logits_by_request(v41_llm(tmp_path, max_num_batched_tokens=64), MIXED, 4)
    monkeypatch.setattr(reference_deepseek_v4, "PREFILL_SCORE_ELEMENTS", 8 * 40 * 3)
    blocked = _logits_by_request(v41_llm(tmp_path, max_num_batched_tokens=64), MIXED, 4)
    for a, b in zip(blocked, whole, strict=True):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


def _truncated_prefill(llm, mode: str | None, table: list[int], slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill a 70-token prompt in chunks [0, 40) and [40, 70) with YoCo truncation ``mode`` (None: off)
    at floor 61; the second chunk's hidden rows and logits."""
    model, prompt = llm.engine.model, torch.tensor(prompts([70], seed=5)[0])
    for start, end in ((0, 40), (40, 70)):
        ctx = request_ctx(llm.engine.runner.backends, start, end, table, slot)
        if mode is not None:
            ctx.truncation_floor_host, ctx.truncation_compact_host = [61], [mode == "compact"]
        with torch.inference_mode():
            hidden = model.forward(prompt[start:end], ctx)
            logits = model.compute_logits(hidden, ctx)
    return hidden, logits


@pytest.mark.parametrize("features", ["all", "engram"])
def test_yoco_truncation_compact_and_mask_agree_on_kept_rows(tmp_path, features):
    """YoCo prefill truncation with every feature on: the consumers (layers 2–4) read candidates picked by
    a producer (layer 1) and the shifted pre-mix of the producers, both narrowed to the kept rows in compact
    mode: compact and mask agree on every row past the floor, compact's dropped rows are zeros, and the
    truncation is real (off differs)."""
    build_v41(tmp_path, **({} if features == "all" else ENGRAM))
    llm = v41_llm(tmp_path)
    kept = slice(61 - 40, 30)
    mask_hidden, mask = _truncated_prefill(llm, "mask", [1, 2, 3, 4, 5], 1)
    compact_hidden, compact = _truncated_prefill(llm, "compact", [6, 7, 8, 9, 10], 2)
    _, off = _truncated_prefill(llm, None, [11, 12, 13, 14, 15], 3)
    assert torch.allclose(mask[kept], compact[kept], atol=1e-5, rtol=0)
    assert compact_hidden[:kept.start].abs().max() == 0 and mask_hidden[:kept.start].abs().max() > 0
    assert (off[kept] - mask[kept]).abs().max() > 1e-3


def test_yoco_truncation_modes_generate_alike_and_free_every_block(tmp_path):
    """Engine level (``plugins.attention``'s bounded replay planner, keep 9 tokens, 32-token chunks): compact
    and mask give the same greedy tokens, logprobs within 1e-5, and every block comes back."""
    build_v41(tmp_path)
    batch = prompts([70, 45, 9], seed=5)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    outs = {}
    for mode in ("mask", "compact"):
        llm = v41_llm(tmp_path, max_num_batched_tokens=32,
                      plugins={"attention": {"enabled": True, "replay": {"mode": mode, "keep_tokens": 9}}})
        outs[mode] = llm.generate(batch, params, use_tqdm=False)
        stats = llm.get_stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    for a, b in zip(outs["mask"], outs["compact"], strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert max(abs(x[t] - y[t]) for t, x, y in zip(ca.token_ids, ca.logprobs, cb.logprobs, strict=True)) < 1e-5


@pytest.mark.parametrize("stated", [False, True], ids=["per-request", "on-device"])
def test_rolling_back_drafts_gives_bitwise_the_same_logits(tmp_path, stated):
    """Every feature on, Engram too: feed 5 draft tokens past a 30-token prefix, roll back (recompute
    from the prefix's end), then feed the true 4 tokens: their logits equal, bit for bit, those of a run
    that never saw the drafts — in the same blocks, state slot and n-gram ring, or fresh ones."""
    build_v41(tmp_path, **ENGRAM)
    llm = v41_llm(tmp_path, cache={"max_backtrack": 6})
    model, backends = llm.engine.model, llm.engine.runner.backends
    prompt, drafts, true = (torch.tensor(prompts([n], seed=s)[0]) for n, s in ((30, 9), (5, 10), (4, 11)))
    with torch.inference_mode():
        def run(table: list[int], slot: int, feed_drafts: bool) -> torch.Tensor:
            model.forward(prompt, request_ctx(backends, 0, 30, table, slot, stated))
            if feed_drafts:
                model.forward(drafts[:1], request_ctx(backends, 30, 31, table, slot, stated))
                model.forward(drafts[1:], request_ctx(backends, 31, 35, table, slot, stated))
            ctx = request_ctx(backends, 30, 34, table, slot, stated)
            return model.compute_logits(model.forward(true, ctx), ctx)

        clean = run([1, 2, 3], 1, feed_drafts=False)
        rolled = run([4, 5, 6], 2, feed_drafts=True)
        rolled_same = run([1, 2, 3], 1, feed_drafts=True)
    assert torch.equal(clean, rolled)
    assert torch.equal(clean, rolled_same)


@pytest.mark.parametrize("plan", ["fixed", "varlen"])
def test_speculative_decoding_leaves_greedy_ids_unchanged(tmp_path, plan):
    """Speculative decoding (the ``oracle`` drafter proposing the known continuation with 30% of drafts
    corrupted): verification steps update the compressors, the n-gram ring and the top-k on device rows
    and rejected drafts roll back; greedy ids equal the plain run's, every block back."""
    from spec_setup import spec_plugins, write_oracle_file

    build_v41(tmp_path, **ENGRAM)
    batch = prompts([30, 17, 25, 8], seed=12)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in v41_llm(tmp_path).generate(batch, params, use_tqdm=False)]
    spec = spec_plugins("oracle", plan, oracle_file=write_oracle_file(tmp_path, batch, plain), oracle_corruption=0.3)
    llm = v41_llm(tmp_path, plugins=spec, cache={"max_backtrack": 5})
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)] == plain
    stats = llm.get_stats()
    assert stats["spec_decode"]["verify_steps"] > 0 and stats["spec_decode"]["mean_acceptance_length"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
