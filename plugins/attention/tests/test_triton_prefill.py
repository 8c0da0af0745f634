"""The Triton paged prefill kernel against the core's reference backend, over unquantized and FP8 caches, and
the ``triton`` backend with prefill chunks in the engine (tiny Llama, tiny Gemma-3 with sliding layers).

Without a GPU everything runs in Triton's interpreter (the root conftest sets ``TRITON_INTERPRET=1``):
shapes are tiny, tiles small (16 query rows, 16 keys) so that a chunk spans several query tiles and a
band several key tiles, through shuffled blocks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from test_triton_attention import DEVICE, forward_context, make_batch

from deepinfer.ops import fp8

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}

CASES = [  # (kv heads, group, head dim, block size, seq lens, query lens, window, floors, dtype)
    (2, 1, 16, 4, [20, 13, 37], [20, 5, 11], 0, False, torch.float32),  # from 0, and after cached prefixes
    (1, 4, 16, 8, [41, 18], [33, 18], 0, False, torch.float32),
    (2, 2, 32, 4, [40, 29], [17, 29], 5, False, torch.float32),  # window < chunk
    (1, 2, 16, 4, [26, 9], [10, 9], 64, False, torch.float32),  # window > context
    (2, 2, 16, 4, [90, 50], [30, 50], 40, False, torch.float32),  # key tiles inside every row's band: unmasked
    (2, 2, 16, 4, [45, 30, 22], [20, 30, 6], 7, True, torch.float32),  # floors, some chunks below them
    (1, 3, 24, 8, [35, 12], [19, 12], 9, False, torch.float32),  # group 3: padded rows; head dim 24: masked lanes
    (2, 4, 16, 4, [38, 21], [25, 21], 6, True, torch.bfloat16),
    (1, 1, 16, 16, [50], [31], 0, False, torch.bfloat16),
]


FP8_CASES = [  # as CASES; head dims split into scale groups of 32 (deepinfer/kv/fp8.py)
    (2, 2, 64, 8, [40], [40], 0, False, torch.float32),  # a whole prompt, causal
    (1, 4, 128, 8, [45, 21], [13, 21], 0, False, torch.float32),  # after a cached prefix, and from 0
    (2, 2, 48, 4, [45, 30, 22], [20, 30, 6], 7, True, torch.float32),  # a full and a short group; floors
    (2, 1, 16, 4, [90, 50], [30, 50], 40, False, torch.float32),  # one short group; unmasked key tiles
    (1, 2, 64, 8, [38, 21, 17], [25, 21, 9], 6, True, torch.bfloat16),
    (2, 2, 128, 16, [50, 19], [31, 19], 0, False, torch.bfloat16),
]


def _floors(seq_lens: list[int]) -> list[int]:
    return [(7 * i + 9) % n for i, n in enumerate(seq_lens)]


def _case_id(case: tuple) -> str:
    return f"kv{case[0]}xg{case[1]}-d{case[2]}-w{case[6]}-f{int(case[7])}-{case[8]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prefill_kernel_matches_the_reference_backend(case: tuple) -> None:
    _check_kernel(case, kv_fp8=False)


@pytest.mark.parametrize("case", FP8_CASES, ids=_case_id)
def test_prefill_kernel_reads_fp8(case: tuple) -> None:
    """The kernel over an FP8 cache equals the reference over the same cache dequantized to float32: the
    kernel's in-register dequantization must be exact."""
    _check_kernel(case, kv_fp8=True)


def _check_kernel(case: tuple, *, kv_fp8: bool) -> None:
    """``paged_prefill_attention`` on ``case`` against ``TorchAttentionBackend`` in float32 over the values
    the cache holds (``kv_fp8``: the random cache quantized, read back by ``fp8.dequantize``)."""
    from deepinfer_attention.triton_prefill import paged_prefill_attention

    from deepinfer.ops import TorchAttentionBackend

    kv_heads, group, head_dim, block_size, seq_lens, query_lens, window, floored, dtype = case
    gen = torch.Generator().manual_seed(sum(seq_lens) + 31 * group + window)
    batch = make_batch(seq_lens, query_lens, block_size, gen)
    ctx = forward_context(batch)
    if floored:
        ctx.visibility_floor_host = _floors(seq_lens)
        ctx.visibility_floor = torch.tensor(ctx.visibility_floor_host, device=DEVICE)
    shape = (batch.num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    q = torch.randn(len(batch.positions), kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    scales: dict[str, torch.Tensor] = {}
    if kv_fp8:
        (k_cache, scales["k_scales"]), (v_cache, scales["v_scales"]) = fp8.quantize(k_cache), fp8.quantize(v_cache)
        k_read = fp8.dequantize(k_cache, scales["k_scales"], torch.float32)
        v_read = fp8.dequantize(v_cache, scales["v_scales"], torch.float32)
    else:
        k_read, v_read = k_cache.float(), v_cache.float()
    # This step's K/V are the rows already at its slots, so the reference's cache write changes nothing.
    k = k_read.view(-1, kv_heads, head_dim)[ctx.slot_mapping]
    v = v_read.view(-1, kv_heads, head_dim)[ctx.slot_mapping]
    scale = head_dim ** -0.5
    expected = TorchAttentionBackend().paged_attention(q.float(), k, v, (k_read, v_read), ctx, scale=scale,
                                                       window=window)
    out = paged_prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.positions,
                                  ctx.query_start_loc_host, range(len(seq_lens)), scale=scale, window=window,
                                  visibility_floor=ctx.visibility_floor if window > 0 else None, block_m=16,
                                  block_n=16, **scales)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_prefill_kernel_writes_only_its_requests_rows() -> None:
    """The backend hands the kernel the long requests of a mixed step and its output tensor: rows of
    other requests stay as they were."""
    from deepinfer_attention.triton_prefill import paged_prefill_attention

    gen = torch.Generator().manual_seed(3)
    batch = make_batch([9, 30, 12], [1, 20, 2], 4, gen)
    k_cache = torch.randn(batch.num_blocks, 4, 1, 16, generator=gen).to(DEVICE)
    v_cache = torch.randn(batch.num_blocks, 4, 1, 16, generator=gen).to(DEVICE)
    q = torch.randn(23, 2, 16, generator=gen).to(DEVICE)
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.positions, [0, 1, 21, 23], [1],
                            scale=0.25, out=out, block_m=16, block_n=16)
    assert (out[0] == 7.0).all() and (out[21:] == 7.0).all() and not (out[1:21] == 7.0).any()


def test_sliding_tiles_visit_only_their_band() -> None:
    """Tiles are listed last-first; with a window the key range a tile walks is its band, not the prefix:
    a cache whose keys outside every band are NaN still gives finite outputs."""
    from deepinfer_attention.triton_prefill import paged_prefill_attention, prefill_tiles

    tiles = prefill_tiles([0, 5, 40], [1], 16, torch.device("cpu")).tolist()
    assert tiles == [[1, 37, 40], [1, 21, 37], [1, 5, 21]]
    gen = torch.Generator().manual_seed(4)
    batch = make_batch([200], [16], 16, gen)  # one tile of 16 queries at positions 184..199
    k_cache = torch.randn(batch.num_blocks, 16, 1, 16, generator=gen).to(DEVICE)
    v_cache = torch.randn(batch.num_blocks, 16, 1, 16, generator=gen).to(DEVICE)
    table = batch.block_tables[0]
    # Window 8: the first query (184) sees keys from 177, so the walk starts at key tile 176; NaN before it.
    for p in range(176):
        k_cache[table[p // 16], p % 16] = float("nan")
        v_cache[table[p // 16], p % 16] = float("nan")
    q = torch.randn(16, 1, 16, generator=gen).to(DEVICE)
    out = paged_prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.positions, [0, 16], [0],
                                  scale=0.25, window=8, block_m=16, block_n=16)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("window,floored", [(0, False), (5, False), (5, True)])
def test_backend_prefill_rows_match_the_reference_backend(window: int, floored: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step (decode, verification, prefill chunks from 0 and after a prefix) through
    ``TritonAttentionBackend``: outputs and cache equal ``TorchAttentionBackend``'s; every row goes through one
    launch of the prefill kernel (none of the decode kernel)."""
    from deepinfer_attention.triton_backends import TritonAttentionBackend

    from deepinfer.ops import TorchAttentionBackend

    gen = torch.Generator().manual_seed(21 + window)
    batch = make_batch([12, 7, 20, 30, 19], [1, 1, 3, 11, 19], 4, gen)
    ctx = forward_context(batch)
    if floored:
        ctx.visibility_floor_host = _floors(batch.seq_lens)
        ctx.visibility_floor = torch.tensor(ctx.visibility_floor_host, device=DEVICE)
    tokens = len(batch.positions)
    k_cache = torch.randn(batch.num_blocks, 4, 2, 16, generator=gen).to(DEVICE)
    v_cache = torch.randn(batch.num_blocks, 4, 2, 16, generator=gen).to(DEVICE)
    caches = [(k_cache, v_cache), (k_cache.clone(), v_cache.clone())]
    q = torch.randn(tokens, 4, 16, generator=gen).to(DEVICE)
    k = torch.randn(tokens, 2, 16, generator=gen).to(DEVICE)
    v = torch.randn(tokens, 2, 16, generator=gen).to(DEVICE)
    expected = TorchAttentionBackend().paged_attention(q, k, v, caches[0], ctx, scale=0.25, window=window)
    launches = _count_calls(monkeypatch, "paged_prefill_attention")
    decode_launches = _count_calls(monkeypatch, "paged_gqa_attention")
    out = TritonAttentionBackend(max_query_len=4).paged_attention(q, k, v, caches[1], ctx, scale=0.25, window=window)
    assert len(launches) == 1 and not decode_launches
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)


@pytest.mark.parametrize("window,floored", [(0, False), (5, True)])
def test_backend_fp8_prefill_rows_match_the_reference_backend(window: int, floored: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step (decode rows, prefill chunks from 0 and after a prefix) over an FP8 cache through
    ``TritonAttentionBackend``, whose chunks run in the prefill kernel: outputs and every cache byte equal
    ``TorchAttentionBackend``'s on the same step."""
    from deepinfer_attention.triton_backends import TritonAttentionBackend

    from deepinfer.kv.specs import PagedKVSpec
    from deepinfer.ops import TorchAttentionBackend

    gen = torch.Generator().manual_seed(41 + window)
    batch = make_batch([12, 7, 30, 19], [1, 1, 11, 19], 4, gen)
    ctx = forward_context(batch)
    if floored:
        ctx.visibility_floor_host = _floors(batch.seq_lens)
        ctx.visibility_floor = torch.tensor(ctx.visibility_floor_host, device=DEVICE)
    tokens, kv_heads, dim = len(batch.positions), 2, 48
    cache = PagedKVSpec(kv_heads, dim).allocate(batch.num_blocks, 4, fp8.FP8_DTYPE, torch.device(DEVICE))
    for i in range(2):  # earlier tokens' K/V, quantized as the write path would
        data, scales = fp8.quantize(torch.randn(batch.num_blocks, 4, kv_heads, dim, generator=gen).to(DEVICE))
        cache[i].view(torch.uint8).copy_(data.view(torch.uint8))
        cache[2 + i].copy_(scales)
    caches = [cache, tuple(t.clone() for t in cache)]
    q = torch.randn(tokens, 2 * kv_heads, dim, generator=gen).to(DEVICE)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(DEVICE)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(DEVICE)
    expected = TorchAttentionBackend().paged_attention(q, k, v, caches[0], ctx, scale=0.25, window=window)
    launches = _count_calls(monkeypatch, "paged_prefill_attention")
    out = TritonAttentionBackend(max_query_len=4).paged_attention(q, k, v, caches[1], ctx, scale=0.25, window=window)
    assert launches
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    for ours, theirs in zip(caches[1], caches[0], strict=True):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


# ------------------------------------------------------------------------------------------- engine

# Small chunks and a repeated prompt: prefill chunks after earlier chunks and after a prefix-cache hit.
ENGINE = {"kv_cache_bytes": 1 << 22, "block_size": 8, "dtype": "float32", "device": DEVICE,
          "max_num_batched_tokens": 24, "max_num_seqs": 3}
ATTENTION = {"plugins": {"attention": {"enabled": True}}, "kernels": {"attention": "triton"}}


def _greedy(folder: Path, prompts: list[list[int]], **overrides: object) -> tuple[list[list[int]], str]:
    from deepinfer import LLM, SamplingParams

    llm = LLM(folder, **ENGINE, **overrides)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tokens += [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params, use_tqdm=False)]  # prefix hit
    name = llm.engine.runner.backends["paged_attention"].name
    llm.shutdown()
    return tokens, name


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Counts the calls of ``triton_prefill.paged_prefill_attention`` or ``triton_decode.paged_gqa_attention`` (the
    backend imports them at each call)."""
    import deepinfer_attention.triton_decode as decode
    import deepinfer_attention.triton_prefill as prefill

    module = prefill if name == "paged_prefill_attention" else decode
    calls, original = [], getattr(module, name)

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _prompts(lengths: list[int], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.usefixtures("one_torch_thread")
def test_tiny_llama_prefill_through_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiny_models import save_tiny

    folder = save_tiny("llama", tmp_path)[1]
    prompts = _prompts([45, 30, 19], 256)
    expected, ref = _greedy(folder, prompts)
    launches = _count_calls(monkeypatch, "paged_prefill_attention")
    tokens, name = _greedy(folder, prompts, **ATTENTION)
    assert (ref, name) == ("torch", "triton") and launches
    assert tokens == expected


@pytest.mark.usefixtures("one_torch_thread")
def test_tiny_gemma3_sliding_prefill_through_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_gemma3 import VOCAB, build_gemma3

    build_gemma3("gemma3-tied").save_pretrained(tmp_path)  # window 8, two sliding layers per global one
    prompts = _prompts([44, 27, 18], VOCAB)
    expected, _ = _greedy(tmp_path, prompts)
    launches = _count_calls(monkeypatch, "paged_prefill_attention")
    tokens, name = _greedy(tmp_path, prompts, **ATTENTION)
    assert name == "triton" and launches and tokens == expected
