"""The GPU batch-invariant backends (``batch_invariant.py``): each kernel's rows are bitwise the same
alone and inside batches of other sizes and at other places, and close to plain torch; in the engine a
request's logprobs are bitwise the same alone and among neighbours.

Without a GPU the kernels run in Triton's interpreter (the root conftest sets ``TRITON_INTERPRET=1``):
shapes are tiny, but K is not a multiple of the tile, rows span several tiles, and keys span several
chunks, so every boundary of the fixed tilings is crossed. Tests marked ``gpu`` run the same checks on
CUDA in bfloat16 with ``auto`` backends (the lead's H200)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tables(lengths: list[int], block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables over shuffled distinct blocks (block 0 left free), one spare column; and the pool size."""
    needed = [-(-n // block_size) for n in lengths]
    pool_size = sum(needed) + 2
    pool = (torch.randperm(pool_size - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lengths), max(needed) + 1, dtype=torch.int64)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(pool[:n])
        pool = pool[n:]
    return tables.to(DEVICE), pool_size


def _fill(cache: torch.Tensor, table: torch.Tensor, rows: torch.Tensor) -> None:
    """Write ``rows [L, ...]`` as one request's positions ``[0, L)`` into a paged cache."""
    block_size = cache.shape[1]
    flat = cache.view(-1, *cache.shape[2:])
    slots = table[torch.arange(rows.shape[0], device=DEVICE) // block_size] * block_size \
        + torch.arange(rows.shape[0], device=DEVICE) % block_size
    flat.index_copy_(0, slots, rows)


# -------------------------------------------------------------------------------------------- GEMM


def test_bi_matmul_rows_do_not_depend_on_the_batch() -> None:
    from deepinfer_attention.batch_invariant_kernels import GEMM_BLOCK_M, bi_matmul

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1, 70, 100, generator=g).to(DEVICE)  # N and K not multiples of the 64-wide tiles
    row = torch.randn(1, 1, 100, generator=g).to(DEVICE)
    alone = bi_matmul(row, weight)[0, 0]
    for rows, at in ((2, 1), (7, 3), (GEMM_BLOCK_M + 5, GEMM_BLOCK_M + 2), (GEMM_BLOCK_M + 5, 0)):
        batch = torch.randn(1, rows, 100, generator=g).to(DEVICE)
        batch[0, at] = row[0, 0]
        assert torch.equal(bi_matmul(batch, weight)[0, at], alone), (rows, at)
    torch.testing.assert_close(alone, row[0, 0] @ weight[0].t(), rtol=1e-5, atol=1e-5)


def test_bi_matmul_batched_and_strided_matches_torch() -> None:
    from deepinfer_attention.batch_invariant_kernels import bi_matmul

    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 3, 20, generator=g).to(DEVICE).transpose(0, 1)  # [3, 9, 20], not contiguous
    w = torch.randn(3, 20, 24, generator=g).to(DEVICE).transpose(1, 2)  # [3, 24, 20], K-major
    torch.testing.assert_close(bi_matmul(x, w), torch.bmm(x, w.transpose(1, 2)), rtol=1e-5, atol=1e-5)


def test_gemm_backend_adds_the_bias_after_the_product() -> None:
    from deepinfer_attention.batch_invariant import TritonBIGemmBackend

    g = torch.Generator().manual_seed(2)
    x, w, b = (torch.randn(2, 3, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, generator=g))
    out = TritonBIGemmBackend().linear(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE))
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out.cpu(), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cuda_bf16_gemm_and_rms_norm_rows_do_not_depend_on_the_batch() -> None:
    """On the GPU in bf16 at model-sized shapes: ``bi_matmul`` and the RMSNorm statistics
    (``norm.mean_square``) give a row the same bits alone and in batches of 3, 100 and 300 rows."""
    from deepinfer_attention.batch_invariant_kernels import bi_matmul

    from deepinfer.model.layers.norm import BATCH_INVARIANT_CUDA_ROWS, mean_square

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(1, 1536, 2048, generator=g, device="cuda", dtype=torch.bfloat16)
    row = torch.randn(1, 1, 2048, generator=g, device="cuda", dtype=torch.bfloat16)
    alone, stats = bi_matmul(row, weight)[0, 0], mean_square(row[0].float(), BATCH_INVARIANT_CUDA_ROWS)
    for rows, at in ((3, 2), (100, 57), (300, 299)):
        batch = torch.randn(1, rows, 2048, generator=g, device="cuda", dtype=torch.bfloat16)
        batch[0, at] = row[0, 0]
        assert torch.equal(bi_matmul(batch, weight)[0, at], alone), rows
        assert torch.equal(mean_square(batch[0].float(), BATCH_INVARIANT_CUDA_ROWS)[at], stats[0]), rows
    torch.testing.assert_close(alone.float(), (row[0, 0].float() @ weight[0].float().t()), rtol=2e-2, atol=2e-1)


# --------------------------------------------------------------------------------------- attention


def _gqa_oracle(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, scale: float,
                window: int) -> torch.Tensor:
    """One token ``q [Hq, D]`` at ``pos`` against one request's ``keys, values [L, Hkv, D]``."""
    lo = max(0, pos + 1 - window) if window else 0
    k, v = keys[lo:pos + 1].float().transpose(0, 1), values[lo:pos + 1].float().transpose(0, 1)  # [Hkv, n, D]
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    weights = torch.softmax(scale * torch.einsum("hd,hnd->hn", q.float(), k), -1)
    return torch.einsum("hn,hnd->hd", weights, v)


@pytest.mark.parametrize("window", [0, 100])
def test_chunked_gqa_token_alone_equals_token_in_any_batch(window: int) -> None:
    """The target (a 300-key request: two 256-key chunks) alone, as a decode row among others, and as
    one token of a multi-token step at several places: the same bits, close to the oracle."""
    from deepinfer_attention.batch_invariant_kernels import chunked_gqa_attention

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, block_size, scale = 4, 2, 16, 16, 0.25
    target_len = 300
    target_q = torch.randn(hq, d, generator=g).to(DEVICE)
    target_k = torch.randn(target_len, hkv, d, generator=g).to(DEVICE)
    target_v = torch.randn(target_len, hkv, d, generator=g).to(DEVICE)

    def run(lengths: list[int], at: int, query_lens: list[int]) -> torch.Tensor:
        """Requests of ``lengths`` keys with the target's at index ``at``; returns the target's last token."""
        tables, pool = _tables(lengths, block_size, g)
        k_cache = torch.randn(pool, block_size, hkv, d, generator=g).to(DEVICE)
        v_cache = torch.randn(pool, block_size, hkv, d, generator=g).to(DEVICE)
        qs, positions, token_req, target_row = [], [], [], -1
        for i, (n, nq) in enumerate(zip(lengths, query_lens, strict=True)):
            if i == at:
                _fill(k_cache, tables[i], target_k)
                _fill(v_cache, tables[i], target_v)
            for p in range(n - nq, n):
                if i == at and p == n - 1:
                    target_row = len(qs)
                    qs.append(target_q)
                else:
                    qs.append(torch.randn(hq, d, generator=g).to(DEVICE))
                positions.append(p)
                token_req.append(i)
        decode_only = all(nq == 1 for nq in query_lens)
        out = chunked_gqa_attention(torch.stack(qs), k_cache, v_cache, tables, torch.tensor(positions, device=DEVICE),
                                    None if decode_only else torch.tensor(token_req, device=DEVICE), scale=scale,
                                    window=window)
        return out[target_row]

    alone = run([target_len], 0, [1])
    for lengths, at, query_lens in (([5, target_len, 270], 1, [1, 1, 1]),
                                    ([target_len, 12], 0, [3, 12]),
                                    ([260, 9, target_len], 2, [1, 9, 5])):
        assert torch.equal(run(lengths, at, query_lens), alone), (lengths, at, query_lens)
    expected = _gqa_oracle(target_q, target_k, target_v, target_len - 1, scale, window)
    torch.testing.assert_close(alone.float(), expected, rtol=1e-5, atol=1e-5)


def test_chunked_mla_token_alone_equals_token_in_any_batch() -> None:
    from deepinfer_attention.batch_invariant_kernels import chunked_mla_attention

    g = torch.Generator().manual_seed(4)
    heads, latent_dim, rope_dim, block_size, scale = 3, 32, 16, 16, 0.2
    target_len = 520
    target_lat = torch.randn(heads, latent_dim, generator=g).to(DEVICE)
    target_pe = torch.randn(heads, rope_dim, generator=g).to(DEVICE)
    target_rows = torch.randn(target_len, latent_dim + rope_dim, generator=g).to(DEVICE)

    def run(lengths: list[int], at: int) -> torch.Tensor:
        tables, pool = _tables(lengths, block_size, g)
        cache = torch.randn(pool, block_size, latent_dim + rope_dim, generator=g).to(DEVICE)
        _fill(cache, tables[at], target_rows)
        q_lat = torch.randn(len(lengths), heads, latent_dim, generator=g).to(DEVICE)
        q_pe = torch.randn(len(lengths), heads, rope_dim, generator=g).to(DEVICE)
        q_lat[at], q_pe[at] = target_lat, target_pe
        positions = torch.tensor(lengths, device=DEVICE) - 1
        return chunked_mla_attention(q_lat, q_pe, cache, tables, positions, None, scale=scale)[at]

    alone = run([target_len], 0)
    for lengths, at in (([3, target_len], 1), ([target_len, 700, 20, 1], 0)):
        assert torch.equal(run(lengths, at), alone), (lengths, at)
    scores = scale * (target_lat @ target_rows[:, :latent_dim].t() + target_pe @ target_rows[:, latent_dim:].t())
    expected = torch.softmax(scores, -1) @ target_rows[:, :latent_dim]
    torch.testing.assert_close(alone, expected, rtol=1e-5, atol=1e-5)


def test_backends_declare_the_capability_and_rank_below_the_defaults() -> None:
    from deepinfer_attention.batch_invariant import TritonBIAttentionBackend, TritonBIGemmBackend, TritonBIMLABackend

    from deepinfer.interfaces import RunRequirements

    for backend in (TritonBIGemmBackend(), TritonBIAttentionBackend(), TritonBIMLABackend()):
        assert backend.capabilities.batch_invariant and backend.capabilities.graph_safe
        req = RunRequirements(device=DEVICE, dtype=torch.float32, kv_dtype="auto", graph_safe=True,
                              batch_invariant=True)
        assert req.missing(backend.capabilities) == []
        assert backend.priority < 0  # below the default backends: a run without the mode never picks them
        if DEVICE == "cpu":  # interpreter: below the core's CPU batch-invariant backends (-10)
            assert backend.priority < -10


# ------------------------------------------------------------------------------------------ engine

TARGET_TOKENS = 4
# (neighbour prompt lengths, target index, steps the neighbours run before the target joins)
COMPOSITIONS = [([7], 1, 0), ([21, 3], 0, 0), ([9, 14, 4], 2, 2)]


def _check_invariance(llm, vocab: int, prompt_len: int) -> None:
    from batch_invariance import check_invariance  # tests/: greedy tokens and top-5 logprobs, alone and among

    check_invariance(llm, vocab, prompt_len, COMPOSITIONS, TARGET_TOKENS)


ON = {"attention": {"enabled": True}, "moe": {"enabled": True}}
ENGINE = {"kv_cache_bytes": 1 << 22, "block_size": 16, "max_model_len": 512, "max_num_batched_tokens": 16}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run; the gpu tests below cover CUDA")
@pytest.mark.usefixtures("one_torch_thread")
def test_tiny_llama_logprobs_bitwise_equal_with_the_triton_backends_named(tiny_llama: Path) -> None:
    """CPU, float32, the Triton backends named: a small token budget chunks the target's prompt
    differently per composition."""
    from deepinfer import LLM

    llm = LLM(tiny_llama, **ENGINE, dtype="float32", device="cpu", plugins=ON,
              kernels={"gemm": "triton_bi", "attention": "triton_bi", "batch_invariant": True})
    try:
        names = {op: llm.engine.runner.backends[op].name for op in ("linear", "paged_attention")}
        assert names == {"linear": "triton_bi", "paged_attention": "triton_bi"}
        _check_invariance(llm, 256, prompt_len=21)
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_v3"])
def test_cuda_logprobs_bitwise_equal_in_every_batch(model: str, request: pytest.FixtureRequest) -> None:
    """CUDA, bfloat16, ``auto`` backends with the mode on: the Triton batch-invariant backends are
    chosen for every op the model calls, and the target's logprobs do not depend on its neighbours."""
    from deepinfer import LLM

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = LLM(request.getfixturevalue(model), **ENGINE, dtype="bfloat16", device="cuda", plugins=ON,
              kernels={"batch_invariant": True})
    try:
        backends = llm.engine.runner.backends
        ops = ("linear", "paged_attention") if model == "tiny_llama" else ("linear", "mla_attention", "experts")
        assert {backends[op].name for op in ops} <= {"triton_bi", "triton_bi_mla"}
        _check_invariance(llm, 256, prompt_len=29)
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_cuda_fixed_speculation_keeps_outputs_bitwise_equal_in_every_batch(tiny_llama: Path, tmp_path: Path) -> None:
    """Deterministic speculative decoding on CUDA (issue 28 item 4): bfloat16, the mode on, the ``fixed``
    plan: the target's tokens and logprobs, greedy and seeded-sampled, are bitwise those it gets alone, in
    every batch. The random model does not copy its prompt's repetition, so ``ngram`` would find no
    drafts; the ``oracle`` drafter knows its greedy reply (recorded first, without speculation) and
    corrupts a fifth of the drafts, so drafts are accepted and rejected."""
    from batch_invariance import check_fixed_speculation, repeating_target

    from deepinfer import LLM, SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = {**ENGINE, "dtype": "bfloat16", "device": "cuda", "kernels": {"batch_invariant": True}}
    target = repeating_target(256)
    llm = LLM(tiny_llama, **engine, plugins=ON)
    reply = llm.generate([target], SamplingParams(temperature=0, max_tokens=13, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    oracle = tmp_path / "oracle.jsonl"
    oracle.write_text(json.dumps({"token_ids": target + list(reply[0].outputs[0].token_ids)}) + "\n")
    llm = LLM(tiny_llama, **engine, plugins={**ON, "spec_decode": {"enabled": True, "drafter": "oracle",
                                                                  "oracle_file": str(oracle), "plan": "fixed",
                                                                  "max_draft": 4}})
    try:
        check_fixed_speculation(llm, 256, COMPOSITIONS, TARGET_TOKENS)
    finally:
        llm.shutdown()
