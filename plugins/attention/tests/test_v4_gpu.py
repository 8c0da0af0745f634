"""GPU checks for the lead's H200 runs (``-m gpu``): ``triton_v4`` compiled for real against the torch
reference on V4-Flash-shaped decode batches (64 heads of 512, window 128, CSA ratio 4 with top-512 of
64 indexer heads of 128, HCA ratio 128) in bf16 and fp32, in a mixed batch, with prefill chunks of up
to 2,048 tokens, under CUDA-graph capture and replay with new inputs, and DeepGEMM's indexer adapter
(``deep_gemm_v4``) when ``deep_gemm`` imports."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from v4_cases import V4Problem, make_problem, relative_error

from deepinfer.ops import TorchSinkAttentionBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

FLASH = {"heads": 64, "dim": 512, "window": 128, "backtrack": 4, "topk": 512, "block_size": 128,
         "index_heads": 64, "index_dim": 128}
# Ragged decode batch: an empty-ish request, a partial ring, fewer entries than top-k, and long ones.
SEQ_LENS = [1, 100, 300, 2100, 4097, 8000]
SCALE = 512 ** -0.5
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _problem(ratio: int, dtype: torch.dtype, seed: int, query_lens: list[int] | None = None) -> V4Problem:
    return make_problem(SEQ_LENS, query_lens or [1] * len(SEQ_LENS), **FLASH, ratio=ratio, seed=seed, dtype=dtype,
                        device="cuda")


def _attend(backend: object, p: V4Problem, ratio: int, sparse: bool, ring: torch.Tensor) -> torch.Tensor:
    return backend.sink_attention(p.q, p.kv, ring, p.ctx, window=FLASH["window"], scale=SCALE, sinks=p.sinks,
                                  compressed=p.compressed, ratio=ratio, selected=p.selected if sparse else None)


def _recall(picks: torch.Tensor, expected: torch.Tensor) -> float:
    """Share of the reference's valid picks that ``picks`` also made (row by row)."""
    hit = total = 0
    for got, ref in zip(picks.tolist(), expected.tolist(), strict=True):
        want = {e for e in ref if e >= 0}
        hit += len(want & {e for e in got if e >= 0})
        total += len(want)
    return hit / max(total, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("ratio", "sparse"), [(4, True), (128, False)], ids=["csa", "hca"])
def test_sink_attention_matches_reference(ratio: int, sparse: bool, dtype: torch.dtype) -> None:
    from deepinfer_attention.triton_v4 import TritonV4Backend

    p = _problem(ratio, dtype, seed=ratio)
    ref_ring, ring = p.ring.clone(), p.ring.clone()
    expected = _attend(TorchSinkAttentionBackend(), p, ratio, sparse, ref_ring)
    out = _attend(TritonV4Backend(), p, ratio, sparse, ring)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    assert torch.equal(ring, ref_ring)


def test_mixed_batch_matches_reference() -> None:
    from deepinfer_attention.triton_v4 import TritonV4Backend

    p = _problem(4, torch.bfloat16, seed=3, query_lens=[1, 1, 1, 1, 5, 300])
    ref_ring, ring = p.ring.clone(), p.ring.clone()
    expected = _attend(TorchSinkAttentionBackend(), p, 4, True, ref_ring)
    assert relative_error(_attend(TritonV4Backend(), p, 4, True, ring), expected) < TOLERANCE[torch.bfloat16]
    assert torch.equal(ring, ref_ring)


@pytest.mark.parametrize(("ratio", "sparse"), [(4, True), (128, False)], ids=["csa", "hca"])
def test_prefill_chunks_match_reference(ratio: int, sparse: bool) -> None:
    """Prefill chunks on the kernels next to decode rows: a whole 2,100-token prompt, chunks of 1,000
    and 2,048 tokens starting mid-sequence (longer than the ring); the indexer's picks too."""
    from deepinfer_attention.triton_v4 import TritonV4Backend

    p = _problem(ratio, torch.bfloat16, seed=17 + ratio, query_lens=[1, 1, 1, 2100, 1000, 2048])
    ref_ring, ring = p.ring.clone(), p.ring.clone()
    expected = _attend(TorchSinkAttentionBackend(), p, ratio, sparse, ref_ring)
    assert relative_error(_attend(TritonV4Backend(), p, ratio, sparse, ring), expected) < TOLERANCE[torch.bfloat16]
    assert torch.equal(ring, ref_ring)
    if sparse:
        kw = {"ratio": ratio, "topk": FLASH["topk"], "scale": FLASH["index_dim"] ** -0.5}
        expected = TorchSinkAttentionBackend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
        picks = TritonV4Backend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
        assert torch.equal(picks < 0, expected < 0)
        assert _recall(picks, expected) > 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_topk_matches_reference(dtype: torch.dtype) -> None:
    from deepinfer_attention.triton_v4 import TritonV4Backend

    p = _problem(4, dtype, seed=7)
    kw = {"ratio": 4, "topk": FLASH["topk"], "scale": FLASH["index_dim"] ** -0.5}
    expected = TorchSinkAttentionBackend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
    picks = TritonV4Backend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
    assert torch.equal(picks < 0, expected < 0)
    assert _recall(picks, expected) > (0.999 if dtype == torch.float32 else 0.99)


def test_decode_step_replays_in_a_cuda_graph() -> None:
    """Capture one decode step (indexer top-k, then attention on its picks); replay it after writing
    new queries, keys and positions into the captured tensors: the replay matches the reference."""
    from deepinfer_attention.triton_v4 import TritonV4Backend

    backend, ref = TritonV4Backend(), TorchSinkAttentionBackend()
    p = _problem(4, torch.bfloat16, seed=11)
    kw = {"ratio": 4, "topk": FLASH["topk"], "scale": FLASH["index_dim"] ** -0.5}

    def step() -> torch.Tensor:
        picks = backend.indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
        return backend.sink_attention(p.q, p.kv, p.ring, p.ctx, window=FLASH["window"], scale=SCALE, sinks=p.sinks,
                                      compressed=p.compressed, ratio=4, selected=picks)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    fresh = _problem(4, torch.bfloat16, seed=12)
    fresh.ctx.positions.sub_(torch.tensor([0, 1, 3, 7, 11, 13], device="cuda"))  # shorter by a few tokens
    for name in ("q", "kv", "index_q", "index_w", "index_keys", "compressed"):
        getattr(p, name).copy_(getattr(fresh, name))
    p.ctx.positions.copy_(fresh.ctx.positions)
    ring_before = p.ring.clone()
    graph.replay()
    torch.cuda.synchronize()
    lens = (p.ctx.positions + 1).tolist()
    check = dataclasses.replace(p.ctx, seq_lens_host=lens, seq_lens=p.ctx.positions + 1)
    picks = ref.indexer_topk(p.index_q, p.index_w, p.index_keys, check, **kw)
    expected = ref.sink_attention(p.q, p.kv, ring_before, check, window=FLASH["window"], scale=SCALE, sinks=p.sinks,
                                  compressed=p.compressed, ratio=4, selected=picks)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(importlib.util.find_spec("deep_gemm") is None, reason="needs deep_gemm")
def test_deep_gemm_indexer_matches_reference() -> None:
    from deepinfer_attention.v4_deep_gemm import DeepGemmIndexerBackend

    backend = DeepGemmIndexerBackend()
    assert backend.available()
    p = _problem(4, torch.bfloat16, seed=13)
    kw = {"ratio": 4, "topk": FLASH["topk"], "scale": FLASH["index_dim"] ** -0.5}
    expected = TorchSinkAttentionBackend().indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
    picks = backend.indexer_topk(p.index_q, p.index_w, p.index_keys, p.ctx, **kw)
    assert torch.equal(picks < 0, expected < 0)
    assert _recall(picks, expected) > 0.9  # FP8 keys and queries move near-ties
