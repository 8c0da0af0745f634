"""``triton_v4`` against the core's plain-torch V4 reference, in Triton's CPU interpreter: sparse sink
attention (sliding-only, dense-compressed and indexer-selected layers) and the indexer's scores and
top-k on ragged batches (rings partially filled and wrapped, fewer entries than top-k, −1 holes), in
decode-only batches, with verification-sized rows and with prefill chunks (whole prompts, chunks
starting mid-sequence, longer than the ring, under visibility floors), all on the kernels; the decode
path reading no host list; the DeepGEMM key packing; and a tiny V4 model giving the reference's greedy
tokens and logits with the backend selected by name and no row left to the reference."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from v4_cases import V4Problem, make_problem, relative_error

from deepinfer.interfaces import ForwardContext
from deepinfer.model.layers.reference_deepseek_v4 import gather_entries
from deepinfer.ops import TorchSinkAttentionBackend

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.usefixtures("one_torch_thread"),
]

# name -> (seq_lens, shape): window 8 + backtrack 2 gives rings of 10 rows, so lengths 1 and 9 leave
# them partly filled and 23, 40 wrapped; "odd" has head counts and widths that are not powers of two,
# rings exactly ``window`` long and top-k above the entries of its short requests; "tiles" needs
# several key tiles per phase and two head blocks.
SHAPES = {
    "small": ([1, 9, 23, 40], {"heads": 4, "dim": 32, "window": 8, "backtrack": 2, "ratio": 4, "topk": 4,
                               "block_size": 16, "index_heads": 8, "index_dim": 16}),
    "odd": ([2, 6, 17, 33, 3], {"heads": 3, "dim": 24, "window": 5, "backtrack": 0, "ratio": 2, "topk": 7,
                                "block_size": 8, "index_heads": 5, "index_dim": 12}),
    "tiles": ([50, 7, 90], {"heads": 20, "dim": 16, "window": 40, "backtrack": 3, "ratio": 2, "topk": 40,
                            "block_size": 16, "index_heads": 20, "index_dim": 16}),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
SCALE = 0.3


def _backend():
    from deepinfer_attention.triton_v4 import TritonV4Backend

    return TritonV4Backend()


# The last two requests' query tokens per batch mode (the others decode): "verify" rows (the graph-safe
# path: at most max_query_len tokens), "mixed" adds a longer chunk.
MODES = {"decode": (1, 1), "verify": (2, 3), "mixed": (2, 6)}


def _problem(name: str, dtype: torch.dtype = torch.float32, mode: str = "decode", seed: int = 0,
             floors: list[int] | None = None) -> V4Problem:
    seq_lens, shape = SHAPES[name]
    query_lens = [1] * (len(seq_lens) - 2) + [min(n, q) for n, q in zip(seq_lens[-2:], MODES[mode], strict=True)]
    return make_problem(seq_lens, query_lens, **shape, seed=seed, dtype=dtype, floors=floors)


def _attend(backend: object, p: V4Problem, name: str, kind: str, ring: torch.Tensor,
            ctx: ForwardContext | None = None) -> torch.Tensor:
    """``backend``'s ``sink_attention`` on problem ``p`` of shape ``name`` for a layer of ``kind``."""
    shape = SHAPES[name][1]
    return backend.sink_attention(
        p.q, p.kv, ring, ctx or p.ctx, window=shape["window"], scale=SCALE, sinks=p.sinks,
        compressed=None if kind == "sliding" else p.compressed, ratio=shape["ratio"],
        selected=p.selected if kind == "sparse" else None)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", ["sliding", "dense", "sparse"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_sink_attention_matches_reference(name: str, kind: str, mode: str) -> None:
    p = _problem(name, mode=mode, seed=len(kind))
    ref_ring, ring = p.ring.clone(), p.ring.clone()
    expected = _attend(TorchSinkAttentionBackend(), p, name, kind, ref_ring)
    out = _attend(_backend(), p, name, kind, ring)
    assert relative_error(out, expected) < TOLERANCE[torch.float32]
    assert torch.equal(ring, ref_ring)  # this step's keys written to the same rows


def test_plugin_offers_the_v4_backends() -> None:
    from deepinfer_attention.config import AttentionConfig
    from deepinfer_attention.plugin import Plugin

    backends = {b.name: b for b in Plugin(AttentionConfig(triton_max_query_len=4)).deepinfer_attention_backends()}
    triton_v4, deep_gemm_v4 = backends["triton_v4"], backends["deep_gemm_v4"]
    assert triton_v4.ops == {"sink_attention", "indexer_topk", "indexer_scores"}
    assert deep_gemm_v4.ops == {"indexer_topk"}
    assert triton_v4.max_query_len == 4 and triton_v4.capabilities.graph_safe
    if torch.cuda.is_available():  # auto: triton_v4 above the reference (0); FP8 DeepGEMM only when named
        assert triton_v4.priority > 0 > deep_gemm_v4.priority
    else:  # interpreter: CPU only when named; DeepGEMM needs CUDA
        assert triton_v4.available() and triton_v4.priority < 0 and "cpu" in triton_v4.capabilities.devices
        assert not deep_gemm_v4.available()


@pytest.fixture
def no_reference(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the calls of the reference's ops (per op name); a test resets the counts once it has
    computed its expectations with the reference."""
    calls = {"sink_attention": 0, "indexer_topk": 0}
    for op in calls:
        original = getattr(TorchSinkAttentionBackend, op)

        def counted(self: TorchSinkAttentionBackend, *args: object, _op: str = op, _original=original,
                    **kwargs: object) -> torch.Tensor:
            calls[_op] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(TorchSinkAttentionBackend, op, counted)
    return calls


@pytest.mark.parametrize("name", ["small", "tiles"])
def test_verification_rows_run_in_the_kernels(name: str, no_reference: dict[str, int]) -> None:
    p = _problem(name, mode="verify", seed=23)
    shape = SHAPES[name][1]
    kw = {"ratio": shape["ratio"], "topk": shape["topk"], "scale": SCALE}
    expected = _attend(TorchSinkAttentionBackend(), p, name, "sparse", p.ring.clone())
    picks = TorchSinkAttentionBackend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
    no_reference.update(sink_attention=0, indexer_topk=0)
    backend = _backend()
    assert relative_error(_attend(backend, p, name, "sparse", p.ring.clone()), expected) < TOLERANCE[torch.float32]
    assert torch.equal(backend.indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw), picks)
    assert no_reference == {"sink_attention": 0, "indexer_topk": 0}


def _prefill_problem(name: str, chunk: str, seed: int, floors: list[int] | None = None) -> V4Problem:
    """Shape ``name``'s requests with prefill chunks: "whole" computes every request's whole sequence
    (from position 0), "mid" a decode row then chunks of the last two thirds of each sequence (starting
    mid-sequence, the longest longer than the ring: its write wraps over keys the chunk's first queries
    read)."""
    seq_lens, shape = SHAPES[name]
    query_lens = list(seq_lens) if chunk == "whole" else [1] + [n - n // 3 for n in seq_lens[1:]]
    return make_problem(seq_lens, query_lens, **shape, seed=seed, floors=floors)


@pytest.mark.parametrize("kind", ["sliding", "dense", "sparse"])
# "tiles" whole (147 tokens) would add a minute in the interpreter and nothing "tiles" mid does not test.
@pytest.mark.parametrize(("name", "chunk"), [(n, c) for n in sorted(SHAPES) for c in ("whole", "mid")
                                             if (n, c) != ("tiles", "whole")])
def test_prefill_chunks_run_in_the_kernels(name: str, kind: str, chunk: str, no_reference: dict[str, int]) -> None:
    """Prefill chunks of every shape on the kernels (the reference is not called): outputs within the
    float32 tolerance, the ring bitwise the reference's afterwards; the indexer's picks equal."""
    p = _prefill_problem(name, chunk, seed=31 + len(kind))
    shape = SHAPES[name][1]
    assert max(p.ctx.query_start_loc_host[i + 1] - p.ctx.query_start_loc_host[i]
               for i in range(len(p.ctx.seq_lens_host))) > shape["window"] + shape["backtrack"]  # the ring wraps
    ref_ring, ring = p.ring.clone(), p.ring.clone()
    expected = _attend(TorchSinkAttentionBackend(), p, name, kind, ref_ring)
    kw = {"ratio": shape["ratio"], "topk": shape["topk"], "scale": SCALE}
    index = (p.index_q, p.index_w, p.index_keys, p.ctx)
    picks = TorchSinkAttentionBackend().indexer_topk(*index, **kw) if kind == "sparse" else None
    no_reference.update(sink_attention=0, indexer_topk=0)
    backend = _backend()
    assert relative_error(_attend(backend, p, name, kind, ring), expected) < TOLERANCE[torch.float32]
    assert torch.equal(ring, ref_ring)
    if picks is not None:
        assert torch.equal(backend.indexer_topk(*index, **kw), picks)
    assert no_reference == {"sink_attention": 0, "indexer_topk": 0}


@pytest.mark.parametrize("kind", ["sliding", "sparse"])
def test_prefill_chunks_under_visibility_floors(kind: str) -> None:
    """Bounded replay in prefill chunks: floors inside the chunks (request 2's and 3's) and above
    every query of request 1 (its queries see only themselves and their entries)."""
    p = _prefill_problem("small", "mid", seed=37, floors=[0, 20, 14, 30])
    ref_ring, ring = p.ring.clone(), p.ring.clone()
    expected = _attend(TorchSinkAttentionBackend(), p, "small", kind, ref_ring)
    assert relative_error(_attend(_backend(), p, "small", kind, ring), expected) < TOLERANCE[torch.float32]
    assert torch.equal(ring, ref_ring)


def test_indexer_row_blocks_bound_the_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a score budget of a few rows (``PREFILL_SCORE_ELEMENTS``), a prefill step's indexer runs in
    blocks of rows — decode-only batches too — and picks exactly what the reference picks."""
    from deepinfer.model.layers import reference_deepseek_v4

    kw = {"ratio": 4, "topk": 4, "scale": SCALE}
    for p in (_prefill_problem("small", "whole", seed=41), _problem("small", seed=43)):
        expected = TorchSinkAttentionBackend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
        width = p.ctx.block_tables.shape[1] * p.index_keys.shape[1]
        with monkeypatch.context() as m:
            m.setattr(reference_deepseek_v4, "PREFILL_SCORE_ELEMENTS", 3 * width)  # blocks of 3 rows
            assert torch.equal(_backend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw), expected)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_visibility_floors_match_reference(mode: str) -> None:
    """Bounded replay: window keys below a request's floor are hidden, but a query's own; request 1's
    queries (positions < 20) sit below its floor and see only themselves (and their entries)."""
    p = _problem("small", mode=mode, seed=29, floors=[0, 20, 18, 36])
    ref_ring, ring = p.ring.clone(), p.ring.clone()
    expected = _attend(TorchSinkAttentionBackend(), p, "small", "sparse", ref_ring)
    assert relative_error(_attend(_backend(), p, "small", "sparse", ring), expected) < TOLERANCE[torch.float32]
    assert torch.equal(ring, ref_ring)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_reference(dtype: torch.dtype) -> None:
    p = _problem("small", dtype=dtype, seed=5)
    expected = _attend(TorchSinkAttentionBackend(), p, "small", "sparse", p.ring.clone())
    out = _attend(_backend(), p, "small", "sparse", p.ring.clone())
    assert out.dtype == dtype
    assert relative_error(out, expected) < TOLERANCE[dtype]
    kw = {"ratio": 4, "topk": 4, "scale": SCALE}
    expected = TorchSinkAttentionBackend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
    assert torch.equal(_backend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw), expected)


def test_sinks_take_mass() -> None:
    """A huge sink logit leaves (almost) nothing for the keys: the output goes to zero."""
    p = _problem("small", seed=7)
    p.sinks.fill_(60.0)
    out = _attend(_backend(), p, "small", "sparse", p.ring.clone())
    assert out.abs().max().item() < 1e-6


def _reference_scores(p: V4Problem, ratio: int) -> list[torch.Tensor]:
    """Per row, the reference formula's scores of the request's complete entries."""
    ctx, out = p.ctx, []
    for i, end in enumerate(ctx.seq_lens_host):
        lo, hi = ctx.query_start_loc_host[i], ctx.query_start_loc_host[i + 1]
        keys = gather_entries(p.index_keys, ctx.block_tables[i], end // ratio).float()
        for t in range(lo, hi):
            complete = (ctx.positions[t].item() + 1) // ratio
            s = torch.relu(torch.einsum("hd,cd->hc", p.index_q[t].float(), keys[:complete])) * SCALE
            out.append((s * p.index_w[t].unsqueeze(-1)).sum(dim=0))
    return out


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_index_scores_match_reference(name: str) -> None:
    from deepinfer_attention.v4_kernels import index_scores

    p = _problem(name, seed=11)
    ratio = SHAPES[name][1]["ratio"]
    scores = index_scores(p.index_q, p.index_w, p.index_keys, p.ctx.block_tables, p.ctx.positions, ratio=ratio,
                          scale=SCALE)
    for t, ref in enumerate(_reference_scores(p, ratio)):
        n = ref.numel()
        assert torch.allclose(scores[t, :n], ref, rtol=1e-5, atol=1e-5)
        assert torch.isneginf(scores[t, n:]).all()


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_indexer_topk_matches_reference(name: str, mode: str) -> None:
    p = _problem(name, mode=mode, seed=13)
    shape = SHAPES[name][1]
    kw = {"ratio": shape["ratio"], "topk": shape["topk"], "scale": SCALE}
    expected = TorchSinkAttentionBackend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
    picks = _backend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
    assert picks.shape == expected.shape and picks.dtype == torch.int64
    assert torch.equal(picks, expected)
    assert (picks == -1).any()  # some request has fewer complete entries than top-k


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_indexer_scores_match_reference(name: str, mode: str) -> None:
    """``indexer_scores`` (DeepSeek-V4.1's ranking reads them) over the block tables' whole width, for the
    step's rows from an offset on: the reference backend's numbers, −inf at the same entries."""
    p = _problem(name, mode=mode, seed=23)
    kw = {"ratio": SHAPES[name][1]["ratio"], "scale": SCALE}
    tokens = p.index_q.shape[0]
    for start in (0, tokens // 2):
        args = (p.index_q[start:], p.index_w[start:], p.index_keys, p.ctx)
        expected = TorchSinkAttentionBackend().indexer_scores(*args, **kw, start=start)
        scores = _backend().indexer_scores(*args, **kw, start=start)
        assert scores.shape == expected.shape == (tokens - start, p.ctx.block_tables.shape[1] * p.index_keys.shape[1])
        assert torch.equal(torch.isneginf(scores), torch.isneginf(expected))
        finite = ~torch.isneginf(expected)
        assert torch.allclose(scores[finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_decode_path_reads_no_host_list() -> None:
    """A graph replay states ``max_query_len == 1`` and keeps the capture's host lists: the decode path
    must give the same answer when every host list is wrong."""
    p = _problem("small", seed=17)
    n = len(p.ctx.seq_lens_host)
    stale = dataclasses.replace(p.ctx, num_decodes=0, max_query_len=1, query_start_loc_host=[0] * (n + 1),
                                seq_lens_host=[0] * n, state_slots_host=[0] * n)
    backend = _backend()
    expected = _attend(backend, p, "small", "sparse", p.ring.clone())
    assert torch.equal(_attend(backend, p, "small", "sparse", p.ring.clone(), stale), expected)
    kw = {"ratio": 4, "topk": 4, "scale": SCALE}
    assert torch.equal(backend.indexer_topk(p.index_q, p.index_w, p.index_keys, stale, **kw),
                       backend.indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw))
    kw.pop("topk")
    for start in (0, 2):
        args = (p.index_q[start:], p.index_w[start:], p.index_keys)
        assert torch.equal(backend.indexer_scores(*args, stale, **kw, start=start),
                           backend.indexer_scores(*args, p.ctx, **kw, start=start))


def test_deep_gemm_key_packing_follows_its_layout() -> None:
    """``pack_fp8_keys`` read back the way DeepGEMM reads its paged FP8 keys (per 64-token block: values,
    then float32 scales) gives each request's entries to FP8 precision (the kernel itself: GPU tests)."""
    from deepinfer_attention.v4_deep_gemm import pack_fp8_keys

    p = _problem("small", seed=19)
    cache, table = pack_fp8_keys(p.index_keys, p.ctx.block_tables)
    blocks, tokens, _, width = cache.shape
    dim = width - 4
    flat = cache.view(blocks, tokens * width)
    values = flat[:, : tokens * dim].view(torch.float8_e4m3fn).float().view(blocks, tokens, dim)
    scales = flat[:, tokens * dim:].contiguous().view(torch.float32).view(blocks, tokens, 1)
    keys = (values * scales)[table.long()].flatten(1, 2)  # [B, n · 64, dim]
    for i, count in enumerate(end // 4 for end in p.ctx.seq_lens_host):
        if count == 0:
            continue
        ref = gather_entries(p.index_keys, p.ctx.block_tables[i], count).float()
        assert relative_error(keys[i, :count], ref) < 0.07  # e4m3: 3 mantissa bits


def test_tiny_v4_model_gives_reference_tokens_and_logits(tmp_path: Path, no_reference: dict[str, int]) -> None:
    """Prefill chunks and decode steps: with ``triton_v4`` named, no row of either op reaches the reference."""
    from test_deepseek_v4 import build, make_llm, prompts
    from tiny_models import record_logits

    from deepinfer import SamplingParams

    build("v4-yarn", tmp_path)
    batch = prompts([3, 29, 12], seed=21)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    on = {"attention": {"enabled": True}}
    # auto keeps the reference on CPU (the interpreter's backends rank below it); naming selects both ops.
    for kernels, expected in (("auto", "torch_v4"), ("triton_v4", "triton_v4")):
        llm = make_llm(tmp_path, plugins=on, kernels={"attention": kernels})
        backends = llm.engine.runner.backends
        assert backends["sink_attention"].name == backends["indexer_topk"].name == expected
        steps = record_logits(llm)
        outs = llm.generate(batch, params, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], torch.cat([logits for _, logits in steps])))
        llm.shutdown()
        calls = sum(no_reference.values())
        assert calls > 0 if expected == "torch_v4" else calls == 0
        no_reference.update(sink_attention=0, indexer_topk=0)
    (ref_ids, ref_logits), (ids, logits) = runs
    assert ids == ref_ids
    assert relative_error(logits, ref_logits) < 1e-4


def _tokens_and_logits(llm: Any, batch: list[list[int]], max_tokens: int, emulate: bool) -> tuple[list, Any, int]:
    """Greedy tokens, the requests' logits rows and the graph replays of ``llm`` (shut down after), its decode
    steps replayed from emulated CUDA graph buckets (static context with the capture's host lists, padding
    rows on the reserved block and state slot 0) when ``emulate``."""
    from tiny_models import record_logits

    from deepinfer import SamplingParams
    from deepinfer.engine.graphs import DecodeGraphs

    engine = llm.engine
    if emulate:
        engine.runner.graphs = DecodeGraphs(engine.model, engine.runner.backends, engine.config.cache.block_size,
                                            torch.device("cpu"), max_tokens=4, max_query_lens=(1,),
                                            max_blocks=engine.kv.blocks_needed(engine.max_model_len), emulate=True,
                                            stateful=True)
        engine.runner.graphs.capture()
    steps = record_logits(llm)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    # A replayed bucket's logits have a row per bucket token: the requests' rows come first.
    logits = torch.cat([lg[:len(ids)] for ids, lg in steps])
    replays = engine.runner.graphs.replays if emulate else 0
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], logits, replays


def test_tiny_v4_model_replays_decode_steps_from_emulated_graphs(tmp_path: Path) -> None:
    """DeepSeek-V4 decode steps replayed from (emulated) CUDA graph buckets give the eager run's tokens and
    logits: the compressors (``Compressor._update_rows``) and ``triton_v4`` read only device tensors."""
    from test_deepseek_v4 import build, make_llm, prompts

    build("v4-yarn", tmp_path)
    batch = prompts([3, 29, 12], seed=23)  # windows of the CSA (4) and HCA (8) compressors close while decoding
    kw = {"plugins": {"attention": {"enabled": True}}, "kernels": {"attention": "triton_v4"}}
    ref_ids, ref_logits, _ = _tokens_and_logits(make_llm(tmp_path, **kw), batch, 12, emulate=False)
    ids, logits, replays = _tokens_and_logits(make_llm(tmp_path, **kw), batch, 12, emulate=True)
    assert replays >= 11  # every decode step of the batch went through a bucket
    assert ids == ref_ids
    assert relative_error(logits, ref_logits) < 1e-5


@pytest.mark.parametrize("engram", [False, True], ids=["plain", "engram"])
def test_tiny_v41_model_replays_decode_steps_from_emulated_graphs(tmp_path: Path, engram: bool) -> None:
    """DeepSeek-V4.1 (cross-layer sharing, candidate blocks, C1/C2 compressors; Engram layers) through
    ``triton_v4``, decode steps replayed from emulated CUDA graph buckets: the reference backend's tokens and
    logits. Its ranking (``v41_indexer.select``) reads ``indexer_scores``, its n-grams the slots' rings
    (``NgramHistory.ngrams_on_device``), and no host list."""
    from test_deepseek_v4 import prompts
    from test_deepseek_v41 import ENGRAM, build_v41, v41_llm

    build_v41(tmp_path, **(ENGRAM if engram else {}))
    batch = prompts([3, 29, 12], seed=29)
    on = {"attention": {"enabled": True}}
    reference = v41_llm(tmp_path, plugins=on)
    assert reference.engine.runner.backends["indexer_scores"].name == "torch_v4"
    ref_ids, ref_logits, _ = _tokens_and_logits(reference, batch, 12, emulate=False)
    kernels = v41_llm(tmp_path, plugins=on, kernels={"attention": "triton_v4"})
    assert kernels.engine.runner.backends["indexer_scores"].name == "triton_v4"
    ids, logits, replays = _tokens_and_logits(kernels, batch, 12, emulate=True)
    assert replays >= 11
    assert ids == ref_ids
    assert relative_error(logits, ref_logits) < 1e-4
