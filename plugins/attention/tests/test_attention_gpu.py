"""The Triton attention kernels on a CUDA GPU at serving shapes (bf16, batch 1/16/64, head dims 64–256,
contexts up to 8k, the engine's 128-token blocks shuffled), under CUDA-graph capture, and in the
engine, where ``kernels.attention: auto`` must pick them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]

# Outputs are averages over thousands of keys (magnitude ~0.03 at 8k): the absolute part must stay
# well below that, or an all-zero output would pass.
ATOL, RTOL = 2e-3, 2e-2


def paged_batch(context_lens: list[int], query_lens: list[int], block_size: int,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(block_tables, positions, token_req, num_blocks)`` on the GPU: request ``i`` holds
    ``context_lens[i]`` keys in distinct shuffled blocks; its last ``query_lens[i]`` are queries."""
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 1
    pool = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(context_lens), max(needed), dtype=torch.int64)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = pool[used:used + n]
        used += n
    positions = [p for n, q in zip(context_lens, query_lens, strict=True) for p in range(n - q, n)]
    token_req = [i for i, q in enumerate(query_lens) for _ in range(q)]
    return (tables.cuda(), torch.tensor(positions, device="cuda"), torch.tensor(token_req, device="cuda"),
            num_blocks)


def rows_of(cache: torch.Tensor, table: torch.Tensor, end: int) -> torch.Tensor:
    return cache[table].flatten(0, 1)[:end].float()


def random_lens(batch: int, max_len: int, gen: torch.Generator) -> list[int]:
    """Ragged lengths in ``[1, max_len]`` with the longest always present."""
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lens[0] = max_len
    return lens


GQA_SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128), "gemma3-1b": (4, 1, 256)}


@pytest.mark.parametrize("batch,max_len", [(1, 8192), (16, 4096), (64, 2048)])
@pytest.mark.parametrize("shape", sorted(GQA_SHAPES))
@pytest.mark.parametrize("window", [0, 1000])
def test_gqa_decode_bf16(shape: str, batch: int, max_len: int, window: int) -> None:
    from deepinfer_attention.triton_decode import paged_gqa_attention

    q_heads, kv_heads, dim = GQA_SHAPES[shape]
    gen = torch.Generator().manual_seed(batch + max_len + window)
    lens = random_lens(batch, max_len, gen)
    tables, positions, _, num_blocks = paged_batch(lens, [1] * batch, 128, gen)
    k_cache = torch.randn(num_blocks, 128, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    v_cache = torch.randn(num_blocks, 128, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(batch, q_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    scale = dim ** -0.5
    out = paged_gqa_attention(q, k_cache, v_cache, tables, positions, None, scale=scale, window=window)
    group = q_heads // kv_heads
    for i, n in enumerate(lens):
        lo = max(0, n - window) if window else 0
        k = rows_of(k_cache, tables[i], n)[lo:].repeat_interleave(group, dim=1)
        v = rows_of(v_cache, tables[i], n)[lo:].repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,lhd->hl", q[i].float(), k) * scale).softmax(-1)
        expected = torch.einsum("hl,lhd->hd", weights, v)
        torch.testing.assert_close(out[i].float(), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_gqa_verification_rows_bf16(batch: int) -> None:
    """1…5 query tokens per request (speculative verification), causal among them."""
    from deepinfer_attention.triton_decode import paged_gqa_attention

    q_heads, kv_heads, dim = GQA_SHAPES["llama8b"]
    gen = torch.Generator().manual_seed(batch)
    lens = random_lens(batch, 3000, gen)
    query_lens = [1 + i % 5 for i in range(batch)]
    lens = [max(n, q) for n, q in zip(lens, query_lens, strict=True)]
    tables, positions, token_req, num_blocks = paged_batch(lens, query_lens, 16, gen)
    k_cache = torch.randn(num_blocks, 16, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    v_cache = torch.randn(num_blocks, 16, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(len(positions), q_heads, dim, generator=gen).to("cuda", torch.bfloat16)
    out = paged_gqa_attention(q, k_cache, v_cache, tables, positions, token_req, scale=dim ** -0.5)
    group = q_heads // kv_heads
    for t in range(len(positions)):
        table, end = tables[token_req[t]], int(positions[t]) + 1
        k = rows_of(k_cache, table, end).repeat_interleave(group, dim=1)
        v = rows_of(v_cache, table, end).repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,lhd->hl", q[t].float(), k) * dim ** -0.5).softmax(-1)
        torch.testing.assert_close(out[t].float(), torch.einsum("hl,lhd->hd", weights, v), atol=ATOL,
                                   rtol=RTOL)


@pytest.mark.parametrize("batch,max_len", [(1, 8192), (16, 4096), (64, 2048)])
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_decode_bf16(heads: int, batch: int, max_len: int) -> None:
    """DeepSeek-V3 (128 heads) and V2-Lite (16 heads) shapes: latent 512, rope 64."""
    from deepinfer_attention.triton_mla import paged_mla_attention

    latent_dim, rope_dim = 512, 64
    gen = torch.Generator().manual_seed(heads + batch)
    lens = random_lens(batch, max_len, gen)
    query_lens = [1 + i % 3 for i in range(batch)]
    lens = [max(n, q) for n, q in zip(lens, query_lens, strict=True)]
    tables, positions, token_req, num_blocks = paged_batch(lens, query_lens, 64, gen)
    cache = torch.randn(num_blocks, 64, latent_dim + rope_dim, generator=gen).to("cuda", torch.bfloat16)
    tokens = len(positions)
    q_lat = torch.randn(tokens, heads, latent_dim, generator=gen).to("cuda", torch.bfloat16)
    q_pe = torch.randn(tokens, heads, rope_dim, generator=gen).to("cuda", torch.bfloat16)
    scale = 192 ** -0.5
    out = paged_mla_attention(q_lat, q_pe, cache, tables, positions, token_req, scale=scale)
    for t in range(tokens):
        rows = rows_of(cache, tables[token_req[t]], int(positions[t]) + 1)
        scores = q_lat[t].float() @ rows[:, :latent_dim].T + q_pe[t].float() @ rows[:, latent_dim:].T
        expected = (scores * scale).softmax(-1) @ rows[:, :latent_dim]
        torch.testing.assert_close(out[t].float(), expected, atol=ATOL, rtol=RTOL)


def test_decode_is_captured_in_a_cuda_graph() -> None:
    """Captured once, replayed after the batch's positions and block tables changed in place: the
    replay equals an eager call on the new values (nothing was read on the host at capture)."""
    from deepinfer_attention.triton_decode import paged_gqa_attention
    from deepinfer_attention.triton_mla import paged_mla_attention

    gen = torch.Generator().manual_seed(3)
    tables, positions, _, num_blocks = paged_batch([3000, 700, 1500, 20], [1] * 4, 128, gen)
    k_cache = torch.randn(num_blocks, 128, 2, 64, generator=gen).to("cuda", torch.bfloat16)
    v_cache = torch.randn(num_blocks, 128, 2, 64, generator=gen).to("cuda", torch.bfloat16)
    latent_cache = torch.randn(num_blocks, 128, 576, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(4, 8, 64, generator=gen).to("cuda", torch.bfloat16)
    q_lat = torch.randn(4, 16, 512, generator=gen).to("cuda", torch.bfloat16)
    q_pe = torch.randn(4, 16, 64, generator=gen).to("cuda", torch.bfloat16)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return (paged_gqa_attention(q, k_cache, v_cache, tables, positions, None, scale=0.125),
                paged_mla_attention(q_lat, q_pe, latent_cache, tables, positions, None, scale=0.07))

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    positions.copy_(torch.tensor([2999, 100, 1499, 3010], device="cuda"))
    tables.copy_(tables.roll(1, dims=0))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for got, want in zip(captured, eager, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_verification_step_through_the_backend_is_captured() -> None:
    """The backend on a verification step whose context states ``max_query_len`` (as a CUDA-graph
    replay's does) is capturable — the token → request map is built on the device — and a replay with
    new queries and keys equals an eager call."""
    from deepinfer_attention.triton_backends import TritonAttentionBackend

    from deepinfer.interfaces import ForwardContext

    gen = torch.Generator().manual_seed(4)
    query_lens = [2, 3, 1, 4]
    tables, positions, token_req, num_blocks = paged_batch([900, 40, 2000, 300], query_lens, 128, gen)
    starts = [0, 2, 5, 6, 10]
    slots = tables[token_req, positions // 128] * 128 + positions % 128
    ctx = ForwardContext(positions=positions, slot_mapping=slots,
                         query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
                         seq_lens=torch.tensor([900, 40, 2000, 300], device="cuda"), block_tables=tables,
                         num_decodes=0, query_start_loc_host=starts, seq_lens_host=[900, 40, 2000, 300],
                         block_size=128, backends={}, max_query_len=4)
    k_cache = torch.randn(num_blocks, 128, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    v_cache = torch.randn(num_blocks, 128, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    q, k, v = (torch.randn(10, heads, 128, generator=gen).to("cuda", torch.bfloat16) for heads in (32, 8, 8))
    backend = TritonAttentionBackend()

    def step() -> torch.Tensor:
        return backend.paged_attention(q, k, v, (k_cache, v_cache), ctx, scale=128 ** -0.5)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for tensor in (q, k, v):
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, step(), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------- engine

PROMPTS = [[5, 9, 77, 3], list(range(10, 200)), [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def _greedy(folder: Path, **overrides: object) -> tuple[list[list[int]], dict]:
    from deepinfer import LLM, SamplingParams

    llm = LLM(folder, device="cuda", dtype="float32", kv_cache_bytes=1 << 26, **overrides)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    backends = dict(llm.engine.runner.backends)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], backends


def test_auto_picks_triton_on_cuda_and_keeps_greedy_tokens(tmp_path: Path) -> None:
    from tiny_deepseek import save_tiny_v3
    from tiny_models import save_tiny

    llama = save_tiny("llama", tmp_path / "llama")[1]
    v3 = save_tiny_v3(tmp_path / "v3")
    for folder, op, name in ((llama, "paged_attention", "triton"), (v3, "mla_attention", "triton_mla")):
        expected, ref = _greedy(folder)
        tokens, chosen = _greedy(folder, plugins={"attention": {"enabled": True}})
        assert ref[op].name.startswith("torch") and chosen[op].name == name
        assert tokens == expected
