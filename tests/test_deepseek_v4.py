"""DeepSeek-V4 against transformers on tiny random configs (fp32, CPU): prefill and cached decode logits,
greedy ids in a mixed batch, after a forced preemption and after prefix-cache hits (exact state
restore), rolling back drafts, the upstream checkpoint names, and dummy weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_deepseek_v3 import _assert_transformers_greedy
from tiny_models import assert_cached_logits_match, randomize

from deepinfer import LLM, SamplingParams
from deepinfer.engine.context import SpanLayout, forward_context
from deepinfer.interfaces import ForwardContext
from deepinfer.kv.blocks import hash_block
from deepinfer.kv.pools import bytes_per_block, state_bytes
from deepinfer.model import deepseek_v4

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256
BLOCK = 16
DECODE_STEPS = 32
MAX_NEW = 24
SEQS = 8  # max_num_seqs: keeps the state slots (one per running request) small
CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
# oracles.md §1b, at vocab 256: window 8, CSA ratio 4 with 8 indexer heads (fewer heads tie), HCA ratio 8.
V4_BASE = {"vocab_size": VOCAB, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32,
           "partial_rotary_factor": 0.25, "num_experts_per_tok": 2, "n_routed_experts": 8, "n_shared_experts": 1,
           "layer_types": [SWA, CSA, HCA, CSA], "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
           "compress_rates": {CSA: 4, HCA: 8}, "sliding_window": 8, "o_groups": 2, "o_lora_rank": 16,
           "index_n_heads": 8, "index_head_dim": 16, "index_topk": 4, "hc_mult": 2, "hc_sinkhorn_iters": 5,
           "max_position_embeddings": 512, "num_nextn_predict_layers": 1, "rope_parameters": YARN,
           "bos_token_id": 0, "eos_token_id": 1}

# name -> (config overrides, checkpoint form)
CONFIGS = {
    # The oracle config: YaRN compress rope, one hash layer, 2 streams; yoco_num_producer_layers: 0 in
    # config.json must change nothing.
    "v4-yarn": ({}, "hf"),
    # 3 streams, two hash layers, window 6, HCA ratio 16 (one entry per block), CSA picking top-2, top-3
    # routing, sigmoid scores, a swiglu_limit low enough to clamp, plain compress rope.
    "v4-clamp": ({"hc_mult": 3, "layer_types": [CSA, HCA, SWA, CSA], "mlp_layer_types": ["hash_moe", "hash_moe",
                  "moe", "moe"], "compress_rates": {CSA: 4, HCA: 16}, "sliding_window": 6, "index_topk": 2,
                  "num_experts_per_tok": 3, "scoring_func": "sigmoid", "swiglu_limit": 0.5,
                  "rope_parameters": {"rope_type": "default"}, "o_groups": 4, "o_lora_rank": 8}, "hf"),
    # The upstream layout: un-prefixed tensor names and the flat config (compress_ratios, rope_scaling,
    # qk_rope_head_dim, num_hash_layers, compress_rope_theta).
    "v4-upstream": ({"sliding_window": 5, "index_topk": 3}, "upstream"),
}

# Not in the CPU matrix: the GPU references (scripts/make_gpu_refs_deepseek_v4.py). index_topk covers every
# compressed entry of the test sequences and every token takes all 8 experts, so bf16 rounding cannot flip
# an indexer or router choice (with top-4 entries and top-2 experts, transformers' own bf16 model differs
# from fp32 by 0.48 x max|logit| on these prompts; this way by 0.05).
GPU_CONFIGS = {"v4-gpu": ({"index_topk": 32, "num_experts_per_tok": 8}, "hf")}


def _upstream_name(name: str) -> str:
    name = name.removeprefix("model.")
    return {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
            "hc_head.hc_scale": "hc_head_scale"}.get(name, name)


def _to_upstream(folder: Path) -> None:
    """Rewrite a transformers-saved folder into the upstream layout (oracles.md §1b)."""
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({_upstream_name(n): t for n, t in tensors.items()}, str(folder / "model.safetensors"))
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    rates = raw.pop("compress_rates")
    raw["compress_ratios"] = [{SWA: 0}.get(t, rates.get(t)) for t in raw.pop("layer_types")]
    raw["compress_rate_csa"] = rates[CSA]
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope["main"]["rope_theta"]
    raw["compress_rope_theta"] = rope["compress"]["rope_theta"]
    raw["rope_scaling"] = {"type": "yarn", **{k: v for k, v in rope["compress"].items()
                                             if k in ("factor", "original_max_position_embeddings", "beta_fast",
                                                      "beta_slow")}}
    raw["qk_rope_head_dim"] = int(raw.pop("partial_rotary_factor") * raw["head_dim"])
    raw["num_hash_layers"] = raw.pop("mlp_layer_types").count("hash_moe")
    path.write_text(json.dumps(raw))


def build(name: str, folder: Path, seed: int = 0, **extra: object) -> torch.nn.Module:
    """A tiny random transformers V4 model (non-zero correction bias, random hash tables) saved to
    ``folder``; ``extra`` keys are added to config.json (deepinfer's extensions)."""
    overrides, form = {**CONFIGS, **GPU_CONFIGS}[name]
    config = transformers.DeepseekV4Config(**{**V4_BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    randomize(model, gen)
    with torch.no_grad():
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif bname.endswith("tid2eid"):
                e, k = config.n_routed_experts, config.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(b.shape[0])]))
    model.save_pretrained(folder)
    if form == "upstream":
        _to_upstream(folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    return model


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]


MIXED = prompts([3, 31, 64, 12, 47, 9], seed=2)
_SYSTEM = prompts([100], seed=3)[0]  # 6 full blocks shared by the conversations
CONVERSATIONS = [_SYSTEM + tail for tail in prompts([3, 17, 9], seed=4)]


def make_llm(folder: Path, **kw: object) -> LLM:
    cache = {"kv_cache_bytes": 1 << 22, "block_size": BLOCK, **kw.pop("cache", {})}
    return LLM(folder, cache=cache, max_num_seqs=SEQS, **kw)


def greedy(llm: LLM, batch: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    extra = {"yoco_num_producer_layers": 0} if request.param == "v4-yarn" else {}
    return build(request.param, folder, **extra), folder


def test_prefill_and_cached_decode_logits_match(tiny):
    model, folder = tiny
    # Prompts longer than the window and than several compression windows and blocks; 32 tokens per
    # step, so the 40-token prompt is prefilled in two chunks.
    llm = make_llm(folder, max_num_batched_tokens=32)
    assert_cached_logits_match(llm, model, prompts([5, 23, 40, 17], seed=1), DECODE_STEPS)


def test_greedy_ids_match_transformers_in_a_mixed_batch(tiny):
    model, folder = tiny
    llm = make_llm(folder, max_num_batched_tokens=48)
    _assert_transformers_greedy(model, MIXED, greedy(llm, MIXED))


def test_a_step_without_tokens_runs_and_changes_no_cache(tiny):
    """An idle expert-parallel rank joins the MoE collectives with such a step (``parallel/worker.py``)."""
    _, folder = tiny
    e = make_llm(folder).engine
    cache = [t for layer in e.pool.layers for t in layer]
    before = [t.clone() for t in cache]
    ctx = forward_context(SpanLayout.of([], BLOCK), block_size=BLOCK, backends=e.runner.backends, device=e.device,
                          state_slots=[])
    with torch.inference_mode():
        hidden = e.model.forward(torch.zeros(0, dtype=torch.int64), ctx)
    assert hidden.shape[0] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, cache, strict=True))


def _blocks_budget(llm: LLM, blocks: int) -> int:
    """``cache.kv_cache_bytes`` that holds ``blocks`` blocks plus the engine's state slots."""
    e = llm.engine
    specs = e.model.cache_specs()
    return (state_bytes(specs, e.num_state_slots, e.max_backtrack, torch.float32)
            + blocks * bytes_per_block(specs, BLOCK, torch.float32))


def test_greedy_ids_survive_preemption(tiny):
    model, folder = tiny
    budget = _blocks_budget(make_llm(folder), 12)
    llm = make_llm(folder, cache={"kv_cache_bytes": budget}, max_model_len=128, max_num_batched_tokens=64)
    _assert_transformers_greedy(model, MIXED, greedy(llm, MIXED))
    assert llm.get_stats()["preemptions"] > 0


def test_greedy_ids_survive_prefix_cache_hits(tiny):
    """The second wave hits the first conversation's two cached blocks: exact replay rebuilds the
    rings and compressor windows from the planner's first token, and leaves the shared blocks as
    they were (bitwise)."""
    model, folder = tiny
    llm = make_llm(folder)
    first = greedy(llm, CONVERSATIONS[:1])
    kv = llm.engine.kv
    chain = [b""]
    for i in range(len(_SYSTEM) // BLOCK):
        chain.append(hash_block(chain[-1], _SYSTEM[i * BLOCK:(i + 1) * BLOCK]))
    shared = [kv.pool.cached[h] for h in chain[1:]]
    hit = len(shared) * BLOCK
    specs = llm.engine.model.cache_specs()
    paged = [layer[:len(spec.paged)] for layer, spec in zip(llm.engine.pool.layers, specs, strict=True)]
    before = [[t[shared].clone() for t in layer] for layer in paged]
    assert any(t.abs().sum() > 0 for layer in before for t in layer)  # compressed entries were written
    starts: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def note():
        out = schedule()
        starts.extend(s.start for s in out.scheduled)
        return out

    llm.engine.scheduler.schedule = note
    rest = greedy(llm, CONVERSATIONS[1:])
    _assert_transformers_greedy(model, CONVERSATIONS, first + rest)
    assert llm.get_stats()["prefix_cache_hit_rate"] > 0.4
    # Both requests hit the 96 cached tokens and replay only the receptive field before them: 4 layers
    # x (window + max_backtrack) + 2 x the largest ratio (ExactReplayPlanner), not the whole prefix.
    layout = llm.engine.info.layout
    field = len(layout.layers) * (layout.layers[0].window + layout.max_backtrack)
    field += 2 * max(layer.ratio for layer in layout.layers)
    assert hit - field > 0
    assert sorted(s for s in starts if s < hit) == [hit - field] * 2
    for old, layer in zip(before, paged, strict=True):
        for o, t in zip(old, layer, strict=True):
            assert torch.equal(o, t[shared])


def test_greedy_ids_survive_aborts_among_prefix_hits(tiny):
    """A first wave that preempts, then a second wave of its prompts, each twice (prefix hits on the first
    wave's blocks, exact replay in 16-token chunks), with every third request aborted after the first step
    (one mid-replay, the rest still waiting): the requests that finish have transformers' greedy ids, the
    aborted ones a prefix of them, and every block and state slot is back. Both waves ignore EOS, so the
    references are the whole ``MAX_NEW`` ids (a reference that stopped at EOS would only be a prefix)."""
    model, folder = tiny
    batch = prompts([30, 17, 25, 8, 40, 22, 13, 35], seed=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    budget = _blocks_budget(make_llm(folder), 22)
    llm = make_llm(folder, cache={"kv_cache_bytes": budget}, max_model_len=96, max_num_batched_tokens=16)
    first = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    _assert_transformers_greedy(model, batch, first)
    assert llm.get_stats()["preemptions"] > 0
    engine = llm.engine
    hits_before = engine.kv.hit_tokens
    order = [i for i in range(len(batch)) for _ in range(2)]
    reqs = [engine.make_request(batch[i], params) for i in order]
    for req in reqs:
        engine.add(req)
    engine.step()
    aborted = reqs[0::3]
    # One aborted request is replaying below its prefix hit: its write floor is above its computed tokens.
    assert any(0 < r.num_computed_tokens <= engine.kv.write_floor(r.request_id) for r in aborted)
    for req in aborted:
        engine.abort(req.request_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.hit_tokens - hits_before >= 4 * BLOCK
    for req, i in zip(reqs, order, strict=True):
        assert req.output_token_ids == first[i][:len(req.output_token_ids)]
        assert req.finish_reason == ("abort" if any(req is r for r in aborted) else "length")
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not engine.kv.slots and len(engine.kv.free_slots) == engine.num_state_slots - 1


# ------------------------------------------------------------------------------ rollback


def request_ctx(backends: dict, start: int, end: int, table: list[int], slot: int = 1,
                stated: bool = False) -> ForwardContext:
    """One request computing positions ``[start, end)`` over block ``table`` and state slot ``slot``;
    ``stated``: the context states its query length (``max_query_len``), as the engine's do."""
    n = end - start
    return ForwardContext(
        positions=torch.arange(start, end), slot_mapping=torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK
                                                                       for p in range(start, end)]),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([end]),
        block_tables=torch.tensor([table]), num_decodes=int(n == 1), query_start_loc_host=[0, n],
        seq_lens_host=[end], block_size=BLOCK, backends=backends,
        state_slots=torch.tensor([slot]), state_slots_host=[slot], write_floor_host=[0],
        max_query_len=n if stated else 0)


def test_batched_decode_compressors_equal_the_per_request_path(tiny, monkeypatch):
    """One-token-per-request steps update the compressors on device tensors (``_update_rows``, what a
    CUDA graph captures); the per-request path gives bitwise the same logprobs, windows closing and not."""
    _, folder = tiny
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3)

    def run() -> list:
        outs = make_llm(folder, max_num_batched_tokens=64).generate(MIXED, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    calls = []
    update = deepseek_v4.Compressor._update_rows
    monkeypatch.setattr(deepseek_v4.Compressor, "_update_rows",
                        lambda self, *a: calls.append(1) or update(self, *a))
    batched = run()
    assert calls
    monkeypatch.setattr(deepseek_v4, "device_rows", lambda ctx, max_query_len: False)
    assert run() == batched


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of every ring (sliding keys, compressor inputs) and every paged compressed entry but the
    reserved scratch block 0's (which device-side updates use as a sink) of the model's layers."""
    out = []
    for layer in model.layers:
        attn = layer.self_attn
        out.append(attn.ring.clone())
        for comp in (attn.compressor, attn.indexer.compressor if attn.indexer else None):
            if comp is not None:
                out += [comp.ring.clone(), comp.paged[1:].clone()]
    return out


def test_verification_steps_update_compressors_as_the_per_request_path(tiny, monkeypatch):
    """Verification-shaped steps — each request 1 to 1 + K query tokens, decode rows among them — update the
    compressors on device tensors (``_update_rows``, what a CUDA graph captures), then each request keeps a
    random number of its tokens (the rest are rejected drafts, recomputed with other ids by the next step):
    after every step the logits, every ring and every paged compressed entry equal bit for bit those of the
    per-request path, windows closing (several per request at CSA ratio 4) and not."""
    _, folder = tiny
    k, steps = 4, 14
    llm = make_llm(folder, cache={"max_backtrack": k + 1})
    model, backends = llm.engine.model, llm.engine.runner.backends
    batch = prompts([23, 9, 40, 14], seed=30)
    gen = torch.Generator().manual_seed(31)
    plan = []  # per step and request: (query tokens, tokens kept, ids)
    for _ in range(steps):
        sizes = torch.randint(1, k + 2, (len(batch),), generator=gen).tolist()
        plan.append([(n, int(torch.randint(1, n + 1, (), generator=gen)), torch.randint(2, VOCAB, (n,), generator=gen))
                     for n in sizes])
    per = -(-(max(map(len, batch)) + steps * (k + 1)) // BLOCK)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(batch))]
    assert tables[-1][-1] < llm.engine.pool.num_blocks
    slots = list(range(1, len(batch) + 1))
    stated: list[int] = []
    of = deepseek_v4._DeviceRows.of
    monkeypatch.setattr(deepseek_v4._DeviceRows, "of", classmethod(lambda cls, ctx: stated.append(ctx.max_query_len)
                                                                    or of(ctx)))

    @torch.inference_mode()
    def run() -> list[list[torch.Tensor]]:
        for cache in llm.engine.pool.layers:
            for t in cache:
                t.zero_()
        lengths, seen = [0] * len(batch), []
        feeds = [[(len(p), len(p), torch.tensor(p)) for p in batch], *plan]  # the prefill, then the steps
        for feed in feeds:
            spans = [(table, n0, n) for table, n0, (n, _, _) in zip(tables, lengths, feed, strict=True)]
            ctx = forward_context(SpanLayout.of(spans, BLOCK), block_size=BLOCK, backends=backends,
                                  device=torch.device("cpu"), state_slots=slots, write_floors=[0] * len(batch))
            logits = model.compute_logits(model.forward(torch.cat([ids for _, _, ids in feed]), ctx), ctx)
            seen.append([logits, *_state(model)])
            lengths = [n0 + kept for n0, (_, kept, _) in zip(lengths, feed, strict=True)]
        return seen

    on_device = run()
    assert max(stated) > 1  # multi-row steps went through the device path
    monkeypatch.setattr(deepseek_v4, "device_rows", lambda ctx, max_query_len: False)
    per_request = run()
    for step, (a, b) in enumerate(zip(on_device, per_request, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"step {step}"


@pytest.mark.parametrize("stated", [False, True], ids=["per-request", "on-device"])
def test_rolling_back_drafts_gives_bitwise_the_same_logits(tmp_path, stated):
    """Feed 5 draft tokens past a 30-token prefix (completing a CSA and an HCA entry), roll back
    (recompute from the prefix's end), then feed the true 4 tokens: their logits equal, bit for bit,
    those of a run that never saw the drafts — in the same blocks and state slot or fresh ones. With
    ``stated`` query lengths the 4-token steps update the compressors on the device (``_update_rows``)."""
    build("v4-yarn", tmp_path)
    llm = make_llm(tmp_path, cache={"max_backtrack": 6})
    model = llm.engine.model
    prompt = torch.tensor(prompts([30], seed=9)[0])
    drafts = torch.tensor(prompts([5], seed=10)[0])
    true = torch.tensor(prompts([4], seed=11)[0])
    with torch.inference_mode():
        def run(table, slot, feed_drafts):
            backends = llm.engine.runner.backends
            model.forward(prompt, request_ctx(backends, 0, 30, table, slot, stated))
            if feed_drafts:  # positions 30..34: a decode step, then a 4-token chunk
                model.forward(drafts[:1], request_ctx(backends, 30, 31, table, slot, stated))
                model.forward(drafts[1:], request_ctx(backends, 31, 35, table, slot, stated))
            ctx = request_ctx(backends, 30, 34, table, slot, stated)
            assert deepseek_v4.device_rows(ctx, model.max_backtrack + 1) == stated
            return model.compute_logits(model.forward(true, ctx), ctx)

        clean = run([1, 2, 3], 1, feed_drafts=False)
        rolled = run([4, 5, 6], 2, feed_drafts=True)
        rolled_same = run([1, 2, 3], 1, feed_drafts=True)
    assert torch.equal(clean, rolled)
    assert torch.equal(clean, rolled_same)


# ------------------------------------------------------------------------------ loading


def test_upstream_mtp_weights_load(tmp_path):
    """Upstream ``mtp.0.*`` tensors (fusion projections, hc head, a sliding-window block) fill
    ``mtp_layers``; an incomplete depth is dropped."""
    build("v4-yarn", tmp_path)
    llm = make_llm(tmp_path)
    layer0 = {n: t for n, t in load_file(str(tmp_path / "model.safetensors")).items()
              if n.startswith("model.layers.2.") and ".compressor." not in n}  # an HCA layer's block ...
    tensors = {f"mtp.0.{n.removeprefix('model.layers.2.')}": t + 0.5 for n, t in layer0.items()}
    tensors = {n: t for n, t in tensors.items() if not n.endswith("tid2eid")}
    gen = torch.Generator().manual_seed(5)
    for leaf, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("norm.weight", (64,)),
                        ("e_proj.weight", (64, 64)), ("h_proj.weight", (64, 64)), ("hc_head_fn", (2, 128)),
                        ("hc_head_base", (2,)), ("hc_head_scale", (1,))):
        tensors[f"mtp.0.{leaf}"] = torch.randn(shape, generator=gen)
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    mtp_llm = make_llm(tmp_path)
    mtp = mtp_llm.engine.model.mtp_layers
    assert len(mtp) == 1
    assert torch.equal(mtp[0].e_proj_weight, tensors["mtp.0.e_proj.weight"])
    assert torch.equal(mtp[0].block.self_attn.o_b_weight, tensors["mtp.0.attn.wo_b.weight"])
    assert torch.equal(mtp[0].hc_head.fn, tensors["mtp.0.hc_head_fn"])
    # The main model is untouched by the MTP file.
    ours, before = mtp_llm.engine.model.layers[2], llm.engine.model.layers[2]
    assert torch.equal(ours.self_attn.o_b_weight, before.self_attn.o_b_weight)
    del tensors["mtp.0.h_proj.weight"]
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    assert len(make_llm(tmp_path).engine.model.mtp_layers) == 0


def test_dummy_weights_generate_with_valid_hash_tables(tmp_path):
    build("v4-clamp", tmp_path)
    llm = make_llm(tmp_path, load_format="dummy")
    model = llm.engine.model
    for layer in model.layers:
        if layer.mlp.is_hash:
            table = layer.mlp.tid2eid
            assert table.shape == (VOCAB, 3) and table.min() >= 0 and table.max() < 8
            assert all(len(set(row)) == 3 for row in table.tolist())  # k distinct experts per token
    outs = llm.generate(prompts([20, 7], seed=12), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]


# ------------------------------------------------------------------------------ YoCo


def _consumer_entries_before_and_after_perturbing(folder: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Compressed entries and indexer keys of layers 2 (HCA) and 3 (CSA) for one prompt, before and
    after randomizing every consumer weight that does not produce layer 2's attention-norm output
    (layer 2's attention projections and MoE, all of layer 3 but its compressors)."""
    llm = make_llm(folder)
    model = llm.engine.model
    ids = torch.tensor(prompts([37], seed=13)[0])
    specs = model.cache_specs()

    def entries(table: list[int], slot: int) -> list[torch.Tensor]:
        with torch.inference_mode():
            model.forward(ids, request_ctx(llm.engine.runner.backends, 0, len(ids), table, slot))
        layers = [llm.engine.pool.layers[i][:len(specs[i].paged)] for i in (2, 3)]
        return [t[table].clone() for layer in layers for t in layer]

    before = entries([1, 2, 3], 1)
    gen = torch.Generator().manual_seed(14)
    with torch.no_grad():
        for name, p in model.named_parameters():
            own = name.startswith(("layers.2.self_attn.", "layers.2.mlp.", "layers.2.ffn_hc.",
                                   "layers.2.post_attention_layernorm.", "layers.3."))
            if own and ".compressor." not in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return before, entries([4, 5, 6], 2)


def test_yoco_consumer_caches_depend_only_on_the_shared_hidden(tmp_path):
    build("v4-yarn", tmp_path / "yoco", yoco_num_producer_layers=2)
    before, after = _consumer_entries_before_and_after_perturbing(tmp_path / "yoco")
    assert len(before) == 3  # HCA entries; CSA entries and indexer keys
    for b, a in zip(before, after, strict=True):
        assert b.abs().sum() > 0 and torch.equal(b, a)
    # Without YoCo the same change reaches layer 3's entries through its own input.
    build("v4-yarn", tmp_path / "plain")
    before, after = _consumer_entries_before_and_after_perturbing(tmp_path / "plain")
    assert not torch.equal(before[1], after[1])


def test_yoco_exact_restore_equals_full_recompute(tmp_path):
    """With YoCo, greedy ids after prefix-cache hits (a partial replay) and after forced preemptions
    equal those of a run that recomputes everything (no prefix cache, no preemption)."""
    build("v4-yarn", tmp_path, yoco_num_producer_layers=2)
    reference = greedy(make_llm(tmp_path, cache={"prefix_caching": False}), CONVERSATIONS + MIXED)
    llm = make_llm(tmp_path)
    assert greedy(llm, CONVERSATIONS[:1]) + greedy(llm, CONVERSATIONS[1:]) == reference[:3]
    assert llm.get_stats()["prefix_cache_hit_rate"] > 0.4
    budget = _blocks_budget(llm, 12)
    tight = make_llm(tmp_path, cache={"kv_cache_bytes": budget}, max_model_len=128, max_num_batched_tokens=64)
    assert greedy(tight, MIXED) == reference[3:]
    assert tight.get_stats()["preemptions"] > 0


def test_yoco_config_is_checked(tmp_path):
    from deepinfer.errors import ConfigError
    from deepinfer.model.deepseek_v4 import V4Dims

    build("v4-yarn", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert V4Dims({**raw, "yoco_num_producer_layers": 1}).yoco == 1
    with pytest.raises(ConfigError, match="yoco_num_producer_layers=4"):
        V4Dims({**raw, "yoco_num_producer_layers": 4})
    with pytest.raises(ConfigError, match="at least one compressed layer"):
        V4Dims({**raw, "yoco_num_producer_layers": 1, "layer_types": [CSA, SWA, SWA, SWA]})
