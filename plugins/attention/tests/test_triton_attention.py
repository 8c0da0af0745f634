"""The Triton paged attention kernels (GQA and absorbed MLA) against plain-torch oracles, the backends
against the core's reference backends on mixed batches, and both inside the engine.

Without a GPU everything runs in Triton's interpreter (the root conftest sets ``TRITON_INTERPRET=1``),
which is slow: shapes are tiny, but ragged, paged through shuffled blocks, split into several chunks
and with several query tokens per request, so every index path of the kernels is exercised."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@dataclass
class Batch:
    """A ragged batch over a shuffled paged cache: request ``i`` has ``seq_lens[i]`` keys, of which the
    last ``query_lens[i]`` are this step's query tokens."""

    seq_lens: list[int]
    query_lens: list[int]
    block_size: int
    block_tables: torch.Tensor  # [B, width], int64
    positions: torch.Tensor  # [N]
    token_req: torch.Tensor  # [N]
    num_blocks: int


def make_batch(seq_lens: list[int], query_lens: list[int], block_size: int, gen: torch.Generator) -> Batch:
    """Block tables take distinct blocks in random order (block 0 left free), padded with zeros."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(needed) + 1  # one spare column, as a runner padding to a longer request would leave
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(pool[:n])
        pool = pool[n:]
    positions = [p for n, q in zip(seq_lens, query_lens, strict=True) for p in range(n - q, n)]
    token_req = [i for i, q in enumerate(query_lens) for _ in range(q)]
    return Batch(seq_lens, query_lens, block_size, tables.to(DEVICE), torch.tensor(positions, device=DEVICE),
                 torch.tensor(token_req, device=DEVICE), num_blocks)


def gather_keys(cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Positions ``[lo, hi)`` of one request's cache rows, in float32."""
    return cache[table].flatten(0, 1)[lo:hi].float()


def reference_gqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch, scale: float,
                  window: int) -> torch.Tensor:
    """One token at a time in float32, K/V heads repeated over their query group."""
    group = q.shape[1] // k_cache.shape[2]
    out = []
    for t in range(q.shape[0]):
        table = batch.block_tables[batch.token_req[t]]
        end = int(batch.positions[t]) + 1
        lo = max(0, end - window) if window > 0 else 0
        k = gather_keys(k_cache, table, lo, end).repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = gather_keys(v_cache, table, lo, end).repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,lhd->hl", q[t].float(), k) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", weights, v))
    return torch.stack(out)


def reference_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, batch: Batch,
                  scale: float) -> torch.Tensor:
    latent_dim = q_lat.shape[2]
    out = []
    for t in range(q_lat.shape[0]):
        rows = gather_keys(cache, batch.block_tables[batch.token_req[t]], 0, int(batch.positions[t]) + 1)
        scores = q_lat[t].float() @ rows[:, :latent_dim].T + q_pe[t].float() @ rows[:, latent_dim:].T
        out.append((scores * scale).softmax(-1) @ rows[:, :latent_dim])
    return torch.stack(out)


GQA_CASES = [  # (kv heads, group, head dim, block size, seq lens, query lens, window, splits, dtype)
    (2, 1, 16, 4, [9, 30, 1], [1, 1, 1], 0, 1, torch.float32),
    (1, 4, 16, 8, [17, 40], [3, 4], 0, 3, torch.float32),
    (2, 2, 32, 16, [33, 5, 20], [2, 1, 4], 7, 2, torch.float32),
    (3, 2, 24, 4, [25, 12], [1, 3], 0, None, torch.float32),  # head dim 24: padded, masked lanes
    (2, 4, 16, 8, [50, 9, 23], [1, 2, 1], 0, 4, torch.bfloat16),
    (1, 2, 16, 4, [19, 27], [4, 1], 5, 3, torch.float16),
]


@pytest.mark.parametrize("case", GQA_CASES, ids=lambda c: f"kv{c[0]}xg{c[1]}-d{c[2]}-w{c[6]}-s{c[7]}-{c[8]}")
def test_gqa_kernel_matches_torch(case: tuple) -> None:
    from deepinfer_attention.triton_decode import paged_gqa_attention

    kv_heads, group, head_dim, block_size, seq_lens, query_lens, window, splits, dtype = case
    gen = torch.Generator().manual_seed(sum(seq_lens) + group)
    batch = make_batch(seq_lens, query_lens, block_size, gen)
    k_cache = torch.randn(batch.num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(batch.num_blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q = torch.randn(len(batch.positions), kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim ** -0.5
    token_req = None if all(n == 1 for n in query_lens) else batch.token_req
    out = paged_gqa_attention(q, k_cache, v_cache, batch.block_tables, batch.positions, token_req, scale=scale,
                              window=window, num_splits=splits, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference_gqa(q, k_cache, v_cache, batch, scale, window)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_gqa_kernel_reads_strided_queries() -> None:
    """Queries as a view of a fused QKV output (row stride larger than heads × dim)."""
    from deepinfer_attention.triton_decode import paged_gqa_attention

    gen = torch.Generator().manual_seed(5)
    batch = make_batch([14, 6], [1, 1], 4, gen)
    k_cache = torch.randn(batch.num_blocks, 4, 1, 16, generator=gen).to(DEVICE)
    v_cache = torch.randn(batch.num_blocks, 4, 1, 16, generator=gen).to(DEVICE)
    qkv = torch.randn(2, 3 * 2 * 16, generator=gen).to(DEVICE)
    q = qkv[:, :32].view(2, 2, 16)
    out = paged_gqa_attention(q, k_cache, v_cache, batch.block_tables, batch.positions, None, scale=0.25,
                              num_splits=2, block_n=16)
    torch.testing.assert_close(out, reference_gqa(q, k_cache, v_cache, batch, 0.25, 0), atol=2e-5, rtol=2e-5)


MLA_CASES = [  # (heads, latent dim, rope dim, block size, seq lens, query lens, splits, dtype)
    (2, 16, 8, 4, [9, 30, 1], [1, 1, 1], 1, torch.float32),
    (5, 32, 16, 8, [17, 40], [3, 2], 3, torch.float32),
    (20, 16, 8, 4, [21, 6], [1, 4], 2, torch.float32),  # two head blocks of 16, the second half empty
    (16, 32, 8, 16, [45, 12, 3], [1, 2, 1], None, torch.bfloat16),
    (4, 16, 8, 4, [26, 11], [2, 1], 4, torch.float16),
]


@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: f"h{c[0]}-c{c[1]}-r{c[2]}-s{c[6]}-{c[7]}")
def test_mla_kernel_matches_torch(case: tuple) -> None:
    from deepinfer_attention.triton_mla import paged_mla_attention

    heads, latent_dim, rope_dim, block_size, seq_lens, query_lens, splits, dtype = case
    gen = torch.Generator().manual_seed(sum(seq_lens) + heads)
    batch = make_batch(seq_lens, query_lens, block_size, gen)
    cache = torch.randn(batch.num_blocks, block_size, latent_dim + rope_dim, generator=gen).to(DEVICE, dtype)
    tokens = len(batch.positions)
    q_lat = torch.randn(tokens, heads, latent_dim, generator=gen).to(DEVICE, dtype)
    q_pe = torch.randn(tokens, heads, rope_dim, generator=gen).to(DEVICE, dtype)
    scale = (latent_dim + rope_dim) ** -0.5
    token_req = None if all(n == 1 for n in query_lens) else batch.token_req
    out = paged_mla_attention(q_lat, q_pe, cache, batch.block_tables, batch.positions, token_req, scale=scale,
                              num_splits=splits, block_n=16)
    assert out.dtype == dtype and out.shape == q_lat.shape
    expected = reference_mla(q_lat, q_pe, cache, batch, scale)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def forward_context(batch: Batch):
    """The runner's ``ForwardContext`` for ``batch``; its rows must list decode rows first."""
    from deepinfer.interfaces import ForwardContext

    starts = [0]
    for n in batch.query_lens:
        starts.append(starts[-1] + n)
    slots = [int(batch.block_tables[r, p // batch.block_size]) * batch.block_size + p % batch.block_size
             for r, p in zip(batch.token_req.tolist(), batch.positions.tolist(), strict=True)]
    num_decodes = 0
    while num_decodes < len(batch.query_lens) and batch.query_lens[num_decodes] == 1:
        num_decodes += 1
    return ForwardContext(
        positions=batch.positions, slot_mapping=torch.tensor(slots, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(batch.seq_lens, device=DEVICE), block_tables=batch.block_tables,
        num_decodes=num_decodes, query_start_loc_host=starts, seq_lens_host=list(batch.seq_lens),
        block_size=batch.block_size, backends={})


# Decode rows, verification rows (≤ 4 tokens) and a prefill chunk longer than max_query_len = 4 (two of
# them: one over cached history, one from position 0); and a batch with no prefill chunk at all.
BACKEND_BATCHES = [([12, 7, 20, 30, 9], [1, 1, 3, 6, 9]), ([12, 7, 20], [1, 3, 2]), ([12, 7, 20], [1, 1, 1])]


@pytest.mark.parametrize("window,floored", [(0, False), (6, False), (6, True)])
@pytest.mark.parametrize("rows", BACKEND_BATCHES, ids=["mixed", "verify", "decode"])
def test_gqa_backend_matches_reference_backend(rows: tuple, window: int, floored: bool) -> None:
    """Outputs and cache contents equal the core's ``TorchAttentionBackend`` on the same step, with
    and without bounded-replay visibility floors (some queries below their floor)."""
    from deepinfer_attention.triton_backends import TritonAttentionBackend

    from deepinfer.ops import TorchAttentionBackend

    gen = torch.Generator().manual_seed(11 + window)
    batch = make_batch(*rows, 4, gen)
    ctx = forward_context(batch)
    if floored:
        ctx.visibility_floor_host = [(5 * i) % n for i, n in enumerate(batch.seq_lens)]
        ctx.visibility_floor = torch.tensor(ctx.visibility_floor_host, device=DEVICE)
    tokens, heads, kv_heads, dim = len(batch.positions), 4, 2, 16
    k_cache = torch.randn(batch.num_blocks, 4, kv_heads, dim, generator=gen).to(DEVICE)
    v_cache = torch.randn(batch.num_blocks, 4, kv_heads, dim, generator=gen).to(DEVICE)
    caches = [(k_cache, v_cache), (k_cache.clone(), v_cache.clone())]
    q = torch.randn(tokens, heads, dim, generator=gen).to(DEVICE)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(DEVICE)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(DEVICE)
    expected = TorchAttentionBackend().paged_attention(q, k, v, caches[0], ctx, scale=0.25, window=window)
    out = TritonAttentionBackend(max_query_len=4).paged_attention(q, k, v, caches[1], ctx, scale=0.25, window=window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)


@pytest.mark.parametrize("rows", BACKEND_BATCHES, ids=["mixed", "verify", "decode"])
def test_mla_backend_matches_reference_backend(rows: tuple) -> None:
    from deepinfer_attention.triton_backends import TritonMLABackend

    from deepinfer.ops import TorchMLABackend

    gen = torch.Generator().manual_seed(13)
    batch = make_batch(*rows, 4, gen)
    ctx = forward_context(batch)
    tokens, heads, nope, rope, latent_dim, v_dim = len(batch.positions), 3, 16, 8, 16, 16
    cache = torch.randn(batch.num_blocks, 4, latent_dim + rope, generator=gen).to(DEVICE)
    caches = [(cache,), (cache.clone(),)]
    q_nope = torch.randn(tokens, heads, nope, generator=gen).to(DEVICE)
    q_pe = torch.randn(tokens, heads, rope, generator=gen).to(DEVICE)
    latent = torch.randn(tokens, latent_dim, generator=gen).to(DEVICE)
    k_pe = torch.randn(tokens, rope, generator=gen).to(DEVICE)
    kv_b = (0.3 * torch.randn(heads * (nope + v_dim), latent_dim, generator=gen)).to(DEVICE)
    args = (q_nope, q_pe, latent, k_pe)
    expected = TorchMLABackend().mla_attention(*args, caches[0], ctx, kv_b_weight=kv_b, scale=0.2)
    out = TritonMLABackend(max_query_len=4).mla_attention(*args, caches[1], ctx, kv_b_weight=kv_b, scale=0.2)
    torch.testing.assert_close(out, expected, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(caches[1][0], caches[0][0], atol=0, rtol=0)


def test_a_stated_bound_reads_no_host_list() -> None:
    """Under a CUDA-graph replay the context states ``max_query_len`` and its host lists and
    ``num_decodes`` are the capture's: the backend must answer from the device tensors alone."""
    from deepinfer_attention.triton_backends import TritonAttentionBackend

    from deepinfer.ops import TorchAttentionBackend

    gen = torch.Generator().manual_seed(17)
    batch = make_batch([12, 7, 20], [1, 3, 2], 4, gen)
    ctx = forward_context(batch)
    k_cache = torch.randn(batch.num_blocks, 4, 1, 16, generator=gen).to(DEVICE)
    v_cache = torch.randn(batch.num_blocks, 4, 1, 16, generator=gen).to(DEVICE)
    q = torch.randn(6, 2, 16, generator=gen).to(DEVICE)
    k = torch.randn(6, 1, 16, generator=gen).to(DEVICE)
    v = torch.randn(6, 1, 16, generator=gen).to(DEVICE)
    expected = TorchAttentionBackend().paged_attention(q, k, v, (k_cache.clone(), v_cache.clone()), ctx, scale=0.25)
    ctx.max_query_len, ctx.num_decodes = 3, 3  # the capture's one-token batch
    ctx.query_start_loc_host = ctx.seq_lens_host = None  # any read would raise
    out = TritonAttentionBackend(max_query_len=4).paged_attention(q, k, v, (k_cache, v_cache), ctx, scale=0.25)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_decode_only_batches_read_no_host_list() -> None:
    """A decode-only step plans without the host lists (the CUDA-graph path)."""
    from deepinfer_attention.triton_backends import plan_rows

    batch = make_batch([5, 9], [1, 1], 4, torch.Generator().manual_seed(0))
    ctx = forward_context(batch)
    ctx.query_start_loc_host = ctx.seq_lens_host = None  # any read would raise
    plan = plan_rows(ctx, 2, 16)
    assert plan.token_req is None and plan.kernel_tokens is None and plan.long_tokens is None


def test_capabilities_and_selection_under_the_interpreter() -> None:
    from deepinfer_attention.config import AttentionConfig
    from deepinfer_attention.plugin import Plugin

    backends = {b.name: b for b in Plugin(AttentionConfig()).deepinfer_attention_backends()}
    gqa, mla = backends["triton"], backends["triton_mla"]
    assert gqa.ops == {"paged_attention"} and mla.ops == {"mla_attention"}
    for backend in (gqa, mla):
        assert backend.available()
        assert backend.capabilities.graph_safe and backend.capabilities.varlen
        assert torch.bfloat16 in backend.capabilities.dtypes
        if torch.cuda.is_available():
            assert backend.priority > 0 and "cuda" in backend.capabilities.devices
        else:  # interpreter: serves CPU only when named; auto keeps the torch reference (priority 0)
            assert backend.priority < 0 and "cpu" in backend.capabilities.devices


# ------------------------------------------------------------------------------------------- engine

ENGINE = {"kv_cache_bytes": 1 << 22, "block_size": 8, "dtype": "float32", "device": DEVICE}
ATTENTION_ON = {"attention": {"enabled": True}}
PROMPTS = [[5, 9, 77, 3], list(range(10, 33)), [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def _greedy(folder: Path, max_tokens: int, **overrides: object) -> tuple[list[list[int]], str, dict]:
    """Greedy tokens for ``PROMPTS``, the names of the attention backends used (GQA/MLA), the stats."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(folder, **ENGINE, **overrides)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    backends = llm.engine.runner.backends
    names = f"{backends['paged_attention'].name}/{backends['mla_attention'].name}"
    stats = llm.get_stats()
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], names, stats


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("model", "slot", "reference", "kernel"),
                         [("tiny_llama", 0, "torch", "triton"), ("tiny_v3", 1, "torch_mla", "triton_mla")])
def test_tiny_model_gives_the_reference_tokens(model: str, slot: int, reference: str, kernel: str,
                                               request: pytest.FixtureRequest) -> None:
    """Llama's GQA through ``triton``, DeepSeek-V3's MLA through ``triton_mla`` (``slot`` picks the op's
    backend name out of ``gqa/mla``): the torch reference's greedy tokens."""
    folder = request.getfixturevalue(model)
    expected, ref, _ = _greedy(folder, 5)
    tokens, names, _ = _greedy(folder, 5, plugins=ATTENTION_ON, kernels={"attention": kernel})
    assert ref.split("/")[slot] == reference and names.split("/")[slot] == kernel
    assert tokens == expected


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_verification_rows_go_through_the_kernel(tiny_llama: Path, tmp_path: Path) -> None:
    """Speculative decoding with an oracle drafter that is sometimes wrong: verification rows of several
    query tokens run through the kernel and greedy tokens stay the reference's."""
    expected, _, _ = _greedy(tiny_llama, 8)
    oracle = tmp_path / "oracle.jsonl"
    oracle.write_text("\n".join(json.dumps({"token_ids": p + o}) for p, o in zip(PROMPTS, expected, strict=True)))
    spec = {"enabled": True, "drafter": "oracle", "plan": "fixed", "max_draft": 2, "oracle_file": str(oracle),
            "oracle_corruption": 0.3}
    # Few sequences: start-up profiles verification-shaped steps up to max_num_seqs × (1 + max_draft)
    # tokens, slow under the interpreter.
    tokens, names, stats = _greedy(tiny_llama, 8, plugins={**ATTENTION_ON, "spec_decode": spec},
                            kernels={"attention": "triton"}, max_num_seqs=2)
    assert names.startswith("triton/") and stats["spec_decode"]["verify_steps"] > 0
    assert tokens == expected
