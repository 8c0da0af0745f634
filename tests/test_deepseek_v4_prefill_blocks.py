"""The DeepSeek-V4 reference attention (``sink_attention``) and indexer (``indexer_topk``) answer prefill
chunks in blocks of query rows (the attention over each block's window band and each row's entries): the
attention agrees, within float32 rounding, across row budgets and with a dense float64 statement of its
semantics; the rings and the indexer's picks are bitwise the same across budgets (ops and a whole model,
fp32 on CPU); and no tensor grows past ``PREFILL_SCORE_ELEMENTS`` however long the chunk and context."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from deepinfer import LLM, SamplingParams
from deepinfer.interfaces import ForwardContext
from deepinfer.model.layers import reference_deepseek_v4
from deepinfer.model.layers.reference_deepseek_v4 import TorchSinkAttentionBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEADS, DIM, WINDOW, RING, RATIO, TOPK, BLOCK = 4, 16, 8, 10, 4, 6, 16
INDEX_HEADS, INDEX_DIM = 5, 8
UNBLOCKED = 1 << 40  # no budget: blocks as large as the attention and the indexer take them
TOLERANCE = 1e-5  # of the largest |output|


def _problem(seq_lens: list[int], query_lens: list[int], seed: int, floors: list[int] | None = None
             ) -> dict[str, Any]:
    """Inputs of one step: request i ends at ``seq_lens[i]`` and computes its last ``query_lens[i]``
    tokens now; shuffled block tables over paged entries; rings filled with older keys; indexer picks
    with −1 holes."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(sum(blocks), generator=gen) + 1
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int64)
    used = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = order[used:used + b]
        used += b
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    positions = torch.cat([torch.arange(e - n, e) for e, n in zip(seq_lens, query_lens, strict=True)])
    tokens = starts[-1]
    selected = torch.full((tokens, TOPK), -1, dtype=torch.int64)
    for t, p in enumerate(positions.tolist()):
        picks = torch.randperm((p + 1) // RATIO, generator=gen)[:TOPK]
        selected[t, torch.randperm(TOPK, generator=gen)[: picks.numel()]] = picks
    slots = list(range(1, len(seq_lens) + 1))
    ctx = ForwardContext(
        positions=positions, slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(seq_lens), block_tables=tables,
        num_decodes=sum(1 for n in query_lens if n == 1), query_start_loc_host=starts, seq_lens_host=list(seq_lens),
        block_size=BLOCK, backends={}, state_slots=torch.tensor(slots), state_slots_host=slots,
        visibility_floor=None if floors is None else torch.tensor(floors), visibility_floor_host=floors)
    num_blocks = sum(blocks) + 1
    return {"q": torch.randn(tokens, HEADS, DIM, generator=gen), "kv": torch.randn(tokens, DIM, generator=gen),
            "ring": torch.randn(len(seq_lens) + 1, RING, DIM, generator=gen),
            "sinks": torch.randn(HEADS, generator=gen),
            "compressed": torch.randn(num_blocks, BLOCK // RATIO, DIM, generator=gen), "selected": selected,
            "index_q": torch.randn(tokens, INDEX_HEADS, INDEX_DIM, generator=gen),
            "index_w": torch.randn(tokens, INDEX_HEADS, generator=gen),
            "index_keys": torch.randn(num_blocks, BLOCK // RATIO, INDEX_DIM, generator=gen), "ctx": ctx}


def _run(p: dict[str, Any]) -> list[torch.Tensor]:
    """Sliding, dense-compressed and indexer-selected attention (each with its ring afterwards), then the
    indexer's top-k."""
    backend = TorchSinkAttentionBackend()
    results = []
    for kind in ("sliding", "dense", "sparse"):
        ring = p["ring"].clone()
        results.append(backend.sink_attention(
            p["q"], p["kv"], ring, p["ctx"], window=WINDOW, scale=0.3, sinks=p["sinks"],
            compressed=None if kind == "sliding" else p["compressed"], ratio=RATIO,
            selected=p["selected"] if kind == "sparse" else None))
        results.append(ring)
    results.append(backend.indexer_topk(p["index_q"], p["index_w"], p["index_keys"], p["ctx"], ratio=RATIO,
                                        topk=TOPK, scale=0.25))
    return results


def _dense(p: dict[str, Any], kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention of one query at a time over its explicitly listed visible keys — window keys of
    ``(p − WINDOW, p]`` (from the ring before the chunk) at or above the request's floor or its own, then
    the complete entries (``dense``) or the selected ones (``sparse``) — with the sink; and the ring after
    the step (the chunk's last ``RING`` positions written)."""
    ctx = p["ctx"]
    q, kv, ring = p["q"].double(), p["kv"].double(), p["ring"].clone()
    out = torch.empty_like(q)
    per_block = p["compressed"].shape[1]
    for i, slot in enumerate(ctx.state_slots_host):
        lo, hi, end = ctx.query_start_loc_host[i], ctx.query_start_loc_host[i + 1], ctx.seq_lens_host[i]
        start = end - (hi - lo)
        floor = 0 if ctx.visibility_floor_host is None else ctx.visibility_floor_host[i]

        def key(pos: int, lo: int = lo, start: int = start, slot: int = slot) -> torch.Tensor:
            return kv[lo + pos - start] if pos >= start else p["ring"][slot, pos % RING].double()

        def entry(e: int, i: int = i) -> torch.Tensor:
            return p["compressed"][ctx.block_tables[i, e // per_block], e % per_block].double()

        for t in range(lo, hi):
            pos = start + t - lo
            visible = [key(k) for k in range(max(0, pos - WINDOW + 1), pos + 1) if k >= floor or k == pos]
            if kind == "dense":
                visible += [entry(e) for e in range((pos + 1) // RATIO)]
            elif kind == "sparse":
                visible += [entry(e) for e in p["selected"][t].tolist() if e >= 0]
            keys = torch.stack(visible)
            logits = torch.cat([q[t] @ keys.T * 0.3, p["sinks"].double().unsqueeze(1)], dim=1)
            out[t] = logits.softmax(dim=-1)[:, :-1] @ keys
        for pos in range(max(start, end - RING), end):
            ring[slot, pos % RING] = p["kv"][lo + pos - start]
    return out, ring


def _assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got.double() - want.double()).abs().max() <= TOLERANCE * want.abs().max()


# A decode row, a fresh prompt, and two chunks after cached positions (one with fewer entries than top-k).
STEP = ([41, 90, 130, 23], [1, 90, 45, 23])


@pytest.mark.parametrize("budget", [1, 700, 4000])
@pytest.mark.parametrize("floors", [None, [30, 0, 110, 19]])
def test_row_blocks_agree_with_each_other_and_a_dense_float64_reference(monkeypatch, budget: int,
                                                                          floors: list[int] | None) -> None:
    """Blocks of one row, of a few rows and of rows that straddle request boundaries (budget 1 still
    takes one row per block), against no budget and against ``_dense``: outputs within ``TOLERANCE``,
    rings and the indexer's picks bitwise."""
    p = _problem(*STEP, seed=budget, floors=floors)
    monkeypatch.setattr(reference_deepseek_v4, "PREFILL_SCORE_ELEMENTS", UNBLOCKED)
    unbudgeted = _run(p)
    monkeypatch.setattr(reference_deepseek_v4, "PREFILL_SCORE_ELEMENTS", budget)
    got = _run(p)
    for k, kind in enumerate(("sliding", "dense", "sparse")):
        out, ring = got[2 * k], got[2 * k + 1]
        want_out, want_ring = _dense(p, kind)
        _assert_near(out, unbudgeted[2 * k])
        _assert_near(out, want_out)
        assert torch.equal(ring, unbudgeted[2 * k + 1])
        assert torch.equal(ring, want_ring)
    assert torch.equal(got[-1], unbudgeted[-1])


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op creates (views of existing tensors are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.largest = max([self.largest, *sizes])
        return out


def _largest_created(p: dict[str, Any]) -> int:
    with _LargestTensor() as mode:
        _run(p)
    return mode.largest


def test_a_long_chunk_never_builds_a_score_tensor_past_the_budget(monkeypatch) -> None:
    """A 1,500-token chunk after 2,500 cached positions: unblocked, the indexer's scores are
    1,500 × heads × 1,000 entries; blocked, nothing created is larger than the budget or the step's own
    ``[T, heads, dim]`` output — among them the dense layer's logits (a window of rows would take
    rows × heads × (2 · window + 1,000 entries)) and the sparse layer's gathered ``[rows, top-k, dim]``."""
    p = _problem([4000], [1500], seed=5)
    budget = 20_000
    bound = max(budget, p["q"].numel())
    monkeypatch.setattr(reference_deepseek_v4, "PREFILL_SCORE_ELEMENTS", UNBLOCKED)
    assert _largest_created(p) >= 1500 * INDEX_HEADS * 1000 > 50 * bound
    monkeypatch.setattr(reference_deepseek_v4, "PREFILL_SCORE_ELEMENTS", budget)
    assert _largest_created(p) <= bound


# A small YoCo V4 (2 consumer layers) with every layer kind; dummy weights, balanced routing.
TINY_V4 = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 128, "hidden_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32,
    "qk_rope_head_dim": 8, "o_groups": 2, "o_lora_rank": 16, "compress_ratios": [0, 4, 16, 4], "num_hash_layers": 1,
    "sliding_window": 8, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8, "hc_mult": 2,
    "hc_sinkhorn_iters": 3, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 1,
}


def _prompt_logprobs(folder: Path) -> tuple[list[int], list[Any]]:
    llm = LLM(folder, load_format="dummy", max_num_seqs=2, max_num_batched_tokens=96,
              cache={"kv_cache_bytes": 1 << 22, "block_size": BLOCK, "prefix_caching": False})
    prompt = torch.randint(2, TINY_V4["vocab_size"], (300,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    llm.shutdown()
    return out.outputs[0].token_ids, [out.prompt_logprobs, out.outputs[0].logprobs]


def test_blocked_model_prefill_is_unchanged(monkeypatch, tmp_path: Path) -> None:
    """A 300-token prompt in 96-token chunks: with blocks of a few rows, the greedy continuation and the
    tokens of every prompt and output logprob are the same, their values within ``TOLERANCE``."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_V4))
    monkeypatch.setattr(reference_deepseek_v4, "PREFILL_SCORE_ELEMENTS", UNBLOCKED)
    want_ids, want = _prompt_logprobs(tmp_path)
    monkeypatch.setattr(reference_deepseek_v4, "PREFILL_SCORE_ELEMENTS", 2_000)
    got_ids, got = _prompt_logprobs(tmp_path)
    assert got_ids == want_ids
    got_rows, want_rows = ([row for rows in logprobs for row in rows] for logprobs in (got, want))
    assert [row and list(row) for row in got_rows] == [row and list(row) for row in want_rows]  # tokens
    _assert_near(*(torch.tensor([v for row in rows if row for v in row.values()]) for rows in (got_rows, want_rows)))
