"""The ``cpu_paged`` attention backend (``paged_attention.py``, ``csrc/paged_attention.c``): the kernel equals
a float64 masked softmax over the gathered keys (GQA, decode and multi-row requests, block boundaries, a
one-key context, sliding windows with visibility floors); in the engine it is what ``auto`` takes with the
plugin, and greedy tokens and logprobs equal the core's backend through prefill, decode, mixed and
verification steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cpu_flags import cpu_has
from deepinfer_cpu.paged_attention import compiler, paged_attention
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler")


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               lens: list[int], rows: list[int], scale: float, window: int, floors: list[int],
               bf16_weights: bool = False) -> torch.Tensor:
    """Per request in float64: gather its keys, then for each of its query rows (its last ``rows[r]``
    positions) mask (causal, window, floor), softmax and weight the values. ``bf16_weights``: each weight
    ``exp(s − max)`` rounded to bf16 before the weighted sum and its normalization (what the value tiles
    multiply)."""
    heads, kv_heads, bs = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    first_row = 0
    for b, (n, m) in enumerate(zip(lens, rows, strict=True)):
        blocks = tables[b, : -(-n // bs)]
        k = k_cache[blocks].reshape(-1, kv_heads, k_cache.shape[3])[:n].double()
        v = v_cache[blocks].reshape(-1, kv_heads, v_cache.shape[3])[:n].double()
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        j = torch.arange(n)
        for i in range(m):
            p = n - m + i
            visible = j <= p
            if window > 0:
                visible &= (j > p - window) & ((j >= floors[b]) | (j == p))
            scores = torch.einsum("hd,jhd->hj", q[first_row + i].double(), k) * scale
            weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            if bf16_weights:
                seen = scores.masked_fill(~visible, float("-inf"))
                weights = (seen - seen.max(dim=-1, keepdim=True).values).exp()
                weights = weights.bfloat16().double()
                weights = weights / weights.sum(dim=-1, keepdim=True)
            out[first_row + i] = torch.einsum("hj,jhd->hd", weights, v)
        first_row += m
    return out


@pytest.mark.parametrize(("window", "with_floors"), [(0, False), (5, False), (7, True)])
@pytest.mark.parametrize("rows", [[1, 1, 1, 1, 1], [1, 4, 5, 2, 16]])  # decode rows; verification / short chunks
@pytest.mark.parametrize(("cache_dtype", "dim"), [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 24)])
def test_kernel_equals_a_float64_masked_softmax(window: int, with_floors: bool, rows: list[int],
                                                cache_dtype: torch.dtype, dim: int) -> None:
    """A bf16 cache is read exactly (the reference takes the same bf16 values); dim 24 takes the kernel's
    loop that is not in 16-lane vectors."""
    gen = torch.Generator().manual_seed(window + len(rows))
    bs, kv_heads, heads = 4, 2, 6
    lens = [1, 4, 5, 13, 30]  # one key; a full block; one past it; several blocks
    width = max(-(-n // bs) for n in lens) + 1
    blocks = len(lens) * width + 3
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(cache_dtype)
    tables = torch.randperm(blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(sum(rows), heads, dim, generator=gen)
    starts = torch.tensor([0, *rows]).cumsum(0)
    floors = [0, 2, 3, 9, 20] if with_floors else [0] * len(lens)
    got = paged_attention(q, k_cache, v_cache, tables, torch.tensor(lens), starts, scale=0.3, window=window,
                          floors=torch.tensor(floors) if with_floors else None)
    want = _reference(q, k_cache, v_cache, tables, lens, rows, 0.3, window, floors)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("window", "floor"), [(0, 0), (9, 20)])
@pytest.mark.parametrize("threads", [2, 3])
def test_one_requests_rows_split_over_the_threads_equal_the_reference(window: int, floor: int, threads: int) -> None:
    """One request of 16 query rows (a short prompt chunk) and one KV head: fewer (request, KV head) pairs than
    two per thread, so the kernel splits the rows into chunks of its own (uneven ones with 3 threads: 16 rows
    in 6 chunks)."""
    gen = torch.Generator().manual_seed(threads + window)
    bs, heads, dim, length, rows = 4, 3, 32, 37, 16
    k_cache = torch.randn(12, bs, 1, dim, generator=gen).bfloat16()
    v_cache = torch.randn(12, bs, 1, dim, generator=gen).bfloat16()
    tables = torch.randperm(12, generator=gen)[:10].view(1, 10)
    q = torch.randn(rows, heads, dim, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_attention(q, k_cache, v_cache, tables, torch.tensor([length]), torch.tensor([0, rows]), scale=0.2,
                              window=window, floors=torch.tensor([floor]) if floor else None)
    finally:
        torch.set_num_threads(before)
    want = _reference(q, k_cache, v_cache, tables, [length], [rows], 0.2, window, [floor])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 6])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(window: int) -> None:
    """A request's 5 query rows in one call (a verification step) equal, bit for bit, each row alone as a
    decode row at its own position: what makes speculative decoding exactly lossless on these kernels."""
    gen = torch.Generator().manual_seed(8 + window)
    bs, kv_heads, heads, dim, length, rows = 4, 2, 6, 64, 34, 5  # the rows straddle 32 keys
    k_cache = torch.randn(12, bs, kv_heads, dim, generator=gen)
    v_cache = torch.randn(12, bs, kv_heads, dim, generator=gen)
    tables = torch.randperm(12, generator=gen)[:10].view(1, 10)
    q = torch.randn(rows, heads, dim, generator=gen)
    together = paged_attention(q, k_cache, v_cache, tables, torch.tensor([length]), torch.tensor([0, rows]),
                               scale=0.125, window=window)
    for i in range(rows):
        alone = paged_attention(q[i:i + 1], k_cache, v_cache, tables, torch.tensor([length - rows + 1 + i]),
                                torch.tensor([0, 1]), scale=0.125, window=window)
        assert torch.equal(alone[0], together[i])


# native: the AMX tiles score a bf16 cache's keys where the CPU has them; skylake-avx512: the register passes;
# x86-64-v2: the portable loops
BUILDS = ["native", pytest.param("skylake-avx512", marks=pytest.mark.skipif(
    not cpu_has("avx512bw"), reason="the AVX-512 build runs only on a CPU with AVX-512")), "x86-64-v2"]


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize(("dim", "block_size", "heads", "kv_heads"), [(64, 16, 9, 3), (128, 32, 8, 2), (64, 16, 4, 4)])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_each_build_equals_the_reference_and_rows_alone(march: str, dim: int, block_size: int, heads: int,
                                                        kv_heads: int, cache_dtype: torch.dtype,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every build of the kernel on the model shapes its fast paths serve (heads of 64 and 128 floats, blocks of 16
    and 32 keys; GQA groups of 3, 4 and 1) with a bf16 model's queries (bf16 values): within float32 rounding of the
    float64 reference for decode rows, verification rows and a 16-row chunk, contexts from one key to several
    hundred; and each verification row bitwise itself alone as a decode row (the AMX tiles' scores, too)."""
    from deepinfer_cpu import paged_attention as module

    kernel = module.load_kernel(march).paged_attention
    monkeypatch.setattr(module, "_paged_attention", lambda: kernel)
    gen = torch.Generator().manual_seed(dim + block_size + heads)
    lens, rows = [1, 16, 17, 40, 300], [1, 5, 16, 7, 3]
    width = max(-(-n // block_size) for n in lens) + 1
    blocks = len(lens) * width + 3
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(cache_dtype)
    tables = torch.randperm(blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(sum(rows), heads, dim, generator=gen).bfloat16().float()
    starts = torch.tensor([0, *rows]).cumsum(0)
    got = paged_attention(q, k_cache, v_cache, tables, torch.tensor(lens), starts, scale=0.3)
    want = _reference(q, k_cache, v_cache, tables, lens, rows, 0.3, 0, [0] * len(lens))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    r = 3  # 7 verification rows at positions 33-39
    for i in range(rows[r]):
        at = int(starts[r]) + i
        alone = paged_attention(q[at:at + 1], k_cache, v_cache, tables[r:r + 1],
                                torch.tensor([lens[r] - rows[r] + 1 + i]), torch.tensor([0, 1]), scale=0.3)
        assert torch.equal(alone[0], got[at])


@pytest.mark.parametrize(("dim", "block_size", "heads", "kv_heads"), [(64, 16, 9, 3), (128, 32, 8, 2)])
def test_prompt_chunks_through_the_tiles_equal_the_reference(dim: int, block_size: int, heads: int,
                                                           kv_heads: int) -> None:
    """Requests of 17, 40 and 100 query rows (prompt chunks: tasks of 16 rows; the first after a cached prefix)
    beside a decode row. On a cache the kernel scores through the AMX tiles its value sums go through them too, with
    the weights rounded to bf16: within 5e-4 of a float64 reference that rounds them so (a weight computed in
    float32 can round to the neighbouring bf16 value: one bf16 step of one weight; the unrounded reference is ~5e-3
    away), the decode row within float32 rounding; elsewhere everything within float32 rounding of the plain
    reference."""
    from deepinfer_cpu.paged_attention import tiles

    gen = torch.Generator().manual_seed(dim + heads)
    lens, rows = [30, 40, 100, 7], [17, 40, 100, 1]
    width = max(-(-n // block_size) for n in lens) + 1
    blocks = len(lens) * width + 3
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).bfloat16()
    tables = torch.randperm(blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(sum(rows), heads, dim, generator=gen).bfloat16().float()
    starts = torch.tensor([0, *rows]).cumsum(0)
    got = paged_attention(q, k_cache, v_cache, tables, torch.tensor(lens), starts, scale=0.2)
    want = _reference(q, k_cache, v_cache, tables, lens, rows, 0.2, 0, [0] * len(lens))
    long_rows = int(starts[3])  # the three prompt chunks' rows come first
    if tiles(torch.bfloat16, 0, dim, block_size):
        rounded = _reference(q, k_cache, v_cache, tables, lens, rows, 0.2, 0, [0] * len(lens), bf16_weights=True)
        assert (want[:long_rows] - rounded[:long_rows]).abs().max() > 1e-3  # the two models differ measurably
        torch.testing.assert_close(got[:long_rows].double(), rounded[:long_rows], rtol=0, atol=5e-4)
        got, want = got[long_rows:], want[long_rows:]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_call_stores_the_steps_keys_and_values_first() -> None:
    """``new_kv``: the step's keys and values land at their slots (what the core's ``write_kv`` does) before
    the step attends to them, in the same call (issue 36)."""
    gen = torch.Generator().manual_seed(5)
    bs, kv_heads, heads, dim, rows, lens = 4, 2, 6, 16, [1, 3], [6, 9]
    k_cache = torch.randn(8, bs, kv_heads, dim, generator=gen)
    v_cache = torch.randn(8, bs, kv_heads, dim, generator=gen)
    tables = torch.tensor([[5, 2, 7], [0, 3, 6]])
    slots = torch.tensor([tables[0, 1] * bs + 1, tables[1, 1] * bs + 2, tables[1, 1] * bs + 3, tables[1, 2] * bs])
    k_new, v_new = torch.randn(4, kv_heads, dim, generator=gen), torch.randn(4, kv_heads, dim, generator=gen)
    q, starts = torch.randn(4, heads, dim, generator=gen), torch.tensor([0, *rows]).cumsum(0)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    k_want.view(-1, kv_heads, dim)[slots], v_want.view(-1, kv_heads, dim)[slots] = k_new, v_new
    want = paged_attention(q, k_want, v_want, tables, torch.tensor(lens), starts, scale=0.3)
    got = paged_attention(q, k_cache, v_cache, tables, torch.tensor(lens), starts, scale=0.3,
                          new_kv=(k_new, v_new, slots))
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))[1]


@pytest.mark.usefixtures("one_torch_thread")
def test_engine_steps_equal_the_core_backend(tiny_llama: Path) -> None:
    """Five prompts through two sequence slots (admissions land beside decode rows), then the same with
    ``ngram`` speculation (verification steps): tokens equal, logprobs within float32 rounding."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (3, 17, 40, 9, 25)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    ngram = {"spec_decode": {"enabled": True, "drafter": "ngram", "max_draft": 3}}
    for extra in ({}, ngram):
        runs = {}
        for cpu in (False, True):
            llm = LLM(tiny_llama, block_size=16, kv_cache_bytes=1 << 22, max_num_seqs=2,
                      plugins={"cpu": {"enabled": cpu}, **extra})
            assert llm.engine.runner.backends["paged_attention"].name == ("cpu_paged" if cpu else "torch")
            runs[cpu] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            llm.shutdown()
        for core, kernel in zip(runs[False], runs[True], strict=True):
            assert core.token_ids == kernel.token_ids
            for a, b in zip(core.logprobs, kernel.logprobs, strict=True):
                for tok in a.keys() & b.keys():
                    assert abs(a[tok] - b[tok]) < 1e-4


@pytest.mark.usefixtures("one_torch_thread")
def test_bfloat16_engine_steps_match_the_core_backend(tiny_llama: Path) -> None:
    """A bf16 model through ``cpu_paged`` (bf16 cache, float32 sums) and through the core's bf16 SDPA: the
    same greedy tokens, chosen-token logprobs within bf16 rounding of the attention output."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (5, 21, 12)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    runs = {}
    for cpu in (False, True):
        llm = LLM(tiny_llama, dtype="bfloat16", block_size=16, kv_cache_bytes=1 << 22, max_num_seqs=2,
                  plugins={"cpu": {"enabled": cpu}}, kernels={"gemm": "torch"})
        assert llm.engine.runner.backends["paged_attention"].name == ("cpu_paged" if cpu else "torch")
        runs[cpu] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    for core, kernel in zip(runs[False], runs[True], strict=True):
        assert core.token_ids == kernel.token_ids
        for tok, a, b in zip(core.token_ids, core.logprobs, kernel.logprobs, strict=True):
            assert abs(a[tok] - b[tok]) < 0.05


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no AVX512-BF16-class CPU")
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("gemm", ["torch", "auto"])  # the layers; the fused stack of plugins.cpu
def test_bfloat16_prompt_chunks_in_the_kernel_match_the_core_backend(gemm: str, tmp_path: Path) -> None:
    """Heads of 64 floats (the tiles' shape): where the kernel scores through the tiles, prompts of 40 and 200
    tokens go to it whole (the core's backend is not called for them) and one of 300 to the core's SDPA. Against
    the core's bf16 run: the first token (the prompt step's) equal, and every chosen token's logprob within bf16
    rounding until the two runs' tokens part (two bf16 computations part at near-ties: with the prompts through
    SDPA this model's runs differ by up to 0.06 too)."""
    from deepinfer_cpu.paged_attention import tiles

    _, folder = save_tiny("llama", tmp_path, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                          num_key_value_heads=2)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (40, 200, 300)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    runs, core_chunks = {}, []
    for cpu in (False, True):
        llm = LLM(folder, dtype="bfloat16", block_size=16, kv_cache_bytes=1 << 24, max_num_seqs=1,
                  plugins={"cpu": {"enabled": cpu}}, kernels={"gemm": "torch" if not cpu else gemm})
        if cpu:
            reference = llm.engine.runner.backends["paged_attention"].reference
            core = reference.paged_attention

            def counted(q, k, v, kv_cache, ctx, *, scale, window=0, core=core):
                core_chunks.append(ctx.max_query_len)
                return core(q, k, v, kv_cache, ctx, scale=scale, window=window)

            reference.paged_attention = counted
        runs[cpu] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert set(core_chunks) == ({300} if tiles(torch.bfloat16, 0, 64, 16) else {40, 200, 300})
    for core, kernel in zip(runs[False], runs[True], strict=True):
        assert core.token_ids[0] == kernel.token_ids[0]
        pairs = zip(core.token_ids, kernel.token_ids, core.logprobs, kernel.logprobs, strict=True)
        for tok, kernel_tok, a, b in pairs:
            if tok != kernel_tok:  # the runs part here
                break
            assert abs(a[tok] - b[tok]) < 0.1
