"""The Triton prefill kernel on a CUDA GPU at serving shapes (bf16, the engine's 128-token blocks shuffled,
head dims 64–256): whole prompts and chunks after cached prefixes against the core's reference backend (over
an FP8 cache too, at the Llama-8B shape), a 32k-token sliding-window prompt (checked against the reference
and timed against a full-attention one, which must cost several times more), and a tiny Gemma-3 in the
engine with prompts longer than its window."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from test_attention_gpu import GQA_SHAPES, paged_batch

from deepinfer.ops import fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]

BLOCK_SIZE = 128
# Full-attention outputs are averages over thousands of keys (magnitude ~0.02): the absolute part stays well
# below that, or an all-zero output would pass.
ATOL, RTOL = 2e-3, 2e-2


def _context(seq_lens: list[int], query_lens: list[int], gen: torch.Generator):
    """A prefill step's ``ForwardContext`` and its number of cache blocks."""
    from deepinfer.interfaces import ForwardContext

    tables, positions, token_req, num_blocks = paged_batch(seq_lens, query_lens, BLOCK_SIZE, gen)
    slots = tables[token_req, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    ctx = ForwardContext(positions=positions, slot_mapping=slots,
                         query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
                         seq_lens=torch.tensor(seq_lens, device="cuda"), block_tables=tables, num_decodes=0,
                         query_start_loc_host=starts, seq_lens_host=list(seq_lens), block_size=BLOCK_SIZE,
                         backends={})
    return ctx, num_blocks


def _step(shape: str, seq_lens: list[int], query_lens: list[int], window: int, seed: int = 0, kv_fp8: bool = False):
    """Outputs of the ``triton`` and reference backends on one bf16 prefill step, and the step's inputs
    (``kv_fp8``: over the random cache quantized, ``cache`` then holding its values read back in bf16)."""
    from deepinfer_attention.triton_backends import TritonAttentionBackend

    from deepinfer.ops import TorchAttentionBackend

    q_heads, kv_heads, dim = GQA_SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    ctx, num_blocks = _context(seq_lens, query_lens, gen)
    cache = [torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, generator=gen).cuda().bfloat16() for _ in range(2)]
    kv_cache = (cache[0], cache[1])
    if kv_fp8:
        (k_data, k_scales), (v_data, v_scales) = fp8.quantize(cache[0]), fp8.quantize(cache[1])
        kv_cache = (k_data, v_data, k_scales, v_scales)
        cache = [fp8.dequantize(k_data, k_scales, torch.bfloat16), fp8.dequantize(v_data, v_scales, torch.bfloat16)]
    tokens = sum(query_lens)
    q = torch.randn(tokens, q_heads, dim, generator=gen).cuda().bfloat16()
    k = cache[0].view(-1, kv_heads, dim)[ctx.slot_mapping]
    v = cache[1].view(-1, kv_heads, dim)[ctx.slot_mapping]
    scale = dim ** -0.5
    # The step's K/V are the values at its slots: each backend's cache write leaves the values as they are.
    out = TritonAttentionBackend().paged_attention(q, k, v, kv_cache, ctx, scale=scale, window=window)
    expected = TorchAttentionBackend().paged_attention(q, k, v, kv_cache, ctx, scale=scale, window=window)
    return out, expected, (q, k, v, cache, ctx, scale)


@pytest.mark.parametrize("window", [0, 1024])
@pytest.mark.parametrize("shape", sorted(GQA_SHAPES))
def test_prompts_and_chunks_after_prefixes_bf16(shape: str, window: int) -> None:
    """A 4k prompt from 0, a 2k chunk after a 6k cached prefix, a 300-token chunk after 9k, and a short one."""
    out, expected, _ = _step(shape, [4096, 8192, 9300, 200], [4096, 2048, 300, 200], window)
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window", [0, 1024])
def test_fp8_prompt_and_chunk_after_prefix_llama8b(window: int) -> None:
    """Over an FP8 cache at the Llama-8B shape: a 4k prompt from 0 and a 2k chunk after a 2k cached prefix,
    bf16, both backends reading the same cache."""
    out, expected, _ = _step("llama8b", [4096, 4096], [4096, 2048], window, kv_fp8=True)
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL, rtol=RTOL)


def test_32k_sliding_prompt_matches_and_costs_its_band() -> None:
    from deepinfer_attention.triton_prefill import paged_prefill_attention

    out, expected, (q, _, _, cache, ctx, scale) = _step("llama8b", [32768], [32768], 4096)
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL, rtol=RTOL)

    def run(window: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        paged_prefill_attention(q, cache[0], cache[1], ctx.block_tables, ctx.positions, ctx.query_start_loc_host,
                                [0], scale=scale, window=window)  # warm-up and compile
        start.record()
        for _ in range(3):
            paged_prefill_attention(q, cache[0], cache[1], ctx.block_tables, ctx.positions,
                                    ctx.query_start_loc_host, [0], scale=scale, window=window)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    # Causal full attention reads ~L²/2 keys per head, the 4096 band ~L·(4096 + tile): about 3.7× fewer.
    assert run(0) > 2.5 * run(4096)


def test_tiny_gemma3_long_prompts_in_the_engine(tmp_path: Path) -> None:
    """``auto`` picks ``triton`` on CUDA; float32 prompts of 300–480 tokens (the tiny config's positions
    stop at 512) over an 8-token window, chunked at 128, give the reference's greedy tokens."""
    from test_gemma3 import VOCAB, build_gemma3

    from deepinfer import LLM, SamplingParams

    build_gemma3("gemma3-tied").save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (480, 300)]
    results = []
    for plugins in ({}, {"attention": {"enabled": True}}):
        llm = LLM(tmp_path, dtype="float32", device="cuda", kv_cache_bytes=1 << 26, max_num_batched_tokens=128,
                  plugins=plugins)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        results.append(([o.outputs[0].token_ids for o in outs], llm.engine.runner.backends["paged_attention"].name))
        llm.shutdown()
    (expected, ref), (tokens, name) = results
    assert (ref, name) == ("torch", "triton")
    assert tokens == expected
