"""The reference backend's prefill attention, answered in blocks of query rows against only the keys each
block can see (window-banded on sliding layers), equals plain dense attention; and a long prompt never
builds a mask or gathers keys beyond those bounds.

The oracle is written out here: scores over every key of the request, masked by the rules of
``AttentionBackend`` (causal; with a window only the last ``window`` keys; with a visibility floor no key
below it but the query's own), softmax, weighted sum.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.interfaces import ForwardContext
from deepinfer.model.layers import reference
from deepinfer.model.layers.reference import TorchAttentionBackend

HQ, HKV, D = 4, 2, 16
BLOCK = 8


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
                     window: int, floor: int) -> torch.Tensor:
    """``q [n, Hq, D]`` at ``positions`` against all of ``k, v [L, Hkv, D]`` (positions 0..L-1), in float64."""
    keys = torch.arange(k.shape[0])
    p = positions[:, None]
    visible = keys <= p
    if window > 0:
        visible &= keys > p - window
        visible &= (keys >= floor) | (keys == p)
    kk = k.double().repeat_interleave(HQ // HKV, dim=1)
    vv = v.double().repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale
    scores = scores.masked_fill(~visible, -math.inf)
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv).float()


def _step(requests: list[tuple[int, int]], decodes: int, floors: list[int] | None, seed: int):
    """A step of requests given as (KV length after the step, new tokens), the first ``decodes`` of them
    decode rows (one new token). Each request's
    cached prefix is written to a paged cache with scrambled block tables. Returns the call's arguments and
    every request's full (q, k, v) for the oracle."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-total // BLOCK) for total, _ in requests)
    num_blocks = sum(-(-total // BLOCK) for total, _ in requests) + 3
    cache = (torch.zeros(num_blocks, BLOCK, HKV, D), torch.zeros(num_blocks, BLOCK, HKV, D))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(requests), max_blocks, dtype=torch.long)
    full, q_rows, k_rows, v_rows, slots, positions = [], [], [], [], [], []
    for r, (total, new) in enumerate(requests):
        blocks = [free.pop() for _ in range(-(-total // BLOCK))]
        tables[r, : len(blocks)] = torch.tensor(blocks)
        slot = torch.tensor([blocks[j // BLOCK] * BLOCK + j % BLOCK for j in range(total)])
        q = torch.randn(total, HQ, D, generator=gen)
        k = torch.randn(total, HKV, D, generator=gen)
        v = torch.randn(total, HKV, D, generator=gen)
        reference.write_kv(k[: total - new], v[: total - new], cache, slot[: total - new])
        full.append((q, k, v))
        q_rows.append(q[total - new:])
        k_rows.append(k[total - new:])
        v_rows.append(v[total - new:])
        slots.append(slot[total - new:])
        positions.append(torch.arange(total - new, total))
    starts = [0]
    for _, new in requests:
        starts.append(starts[-1] + new)
    seq_lens = [total for total, _ in requests]
    ctx = ForwardContext(
        positions=torch.cat(positions), slot_mapping=torch.cat(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens), block_tables=tables,
        num_decodes=decodes,
        query_start_loc_host=starts, seq_lens_host=seq_lens, block_size=BLOCK, backends={},
        visibility_floor=None if floors is None else torch.tensor(floors), visibility_floor_host=floors,
    )
    return (torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows), cache, ctx), full


def _check(requests: list[tuple[int, int]], window: int, floors: list[int] | None, seed: int,
           decodes: int = 0) -> None:
    (q, k, v, cache, ctx), full = _step(requests, decodes, floors, seed)
    scale = D ** -0.5
    out = TorchAttentionBackend().paged_attention(q, k, v, cache, ctx, scale=scale, window=window)
    for r, (total, new) in enumerate(requests):
        fq, fk, fv = full[r]
        expected = _dense_attention(fq[total - new:], fk, fv, torch.arange(total - new, total), scale, window,
                                    0 if floors is None else floors[r])
        lo, hi = ctx.query_start_loc_host[r], ctx.query_start_loc_host[r + 1]
        torch.testing.assert_close(out[lo:hi], expected, atol=2e-5, rtol=2e-5)


# (KV length after the step, new tokens): a decode row first, then fresh prompts and chunks after a cached
# prefix, with lengths that straddle block, window and query-row boundaries.
MIXED = [(41, 1), (53, 53), (70, 29), (17, 17), (100, 37), (9, 4)]


@pytest.mark.parametrize("rows", [5, 16, 1024])
@pytest.mark.parametrize("window", [0, 7, 33])
def test_blocked_prefill_equals_dense_attention(monkeypatch, rows: int, window: int) -> None:
    monkeypatch.setattr(reference, "PREFILL_QUERY_ROWS", rows)
    _check(MIXED, window, None, seed=rows * 100 + window, decodes=1)


@pytest.mark.parametrize("rows", [6, 1024])
def test_blocked_prefill_respects_the_visibility_floor(monkeypatch, rows: int) -> None:
    monkeypatch.setattr(reference, "PREFILL_QUERY_ROWS", rows)
    # Floors inside the window, above some chunks' first queries, and 0 (no floor).
    _check(MIXED, 12, [30, 40, 50, 0, 90, 7], seed=rows, decodes=1)


def _record_shapes(monkeypatch) -> tuple[list[torch.Size], list[torch.Size]]:
    """Record the shape of every mask ``_visible`` builds and every block table ``gather_kv`` reads."""
    masks: list[torch.Size] = []
    tables: list[torch.Size] = []
    visible, gather = reference._visible, reference.gather_kv

    def recording_visible(*args, **kwargs):
        mask = visible(*args, **kwargs)
        masks.append(mask.shape)
        return mask

    def recording_gather(kv_cache, block_table, dtype):
        tables.append(block_table.shape)
        return gather(kv_cache, block_table, dtype)

    monkeypatch.setattr(reference, "_visible", recording_visible)
    monkeypatch.setattr(reference, "gather_kv", recording_gather)
    return masks, tables


def test_long_sliding_prompt_builds_only_banded_masks(monkeypatch) -> None:
    """A 3,000-token prompt on a 64-token window, 256 rows per block: every mask is at most 256 × 319."""
    rows, window, length = 256, 64, 3000
    monkeypatch.setattr(reference, "PREFILL_QUERY_ROWS", rows)
    masks, _ = _record_shapes(monkeypatch)
    _check([(length, length)], window, None, seed=1)
    assert len(masks) == -(-length // rows)
    assert max(shape[-1] for shape in masks) <= rows + window - 1
    assert max(math.prod(shape) for shape in masks) <= rows * (rows + window - 1)


def test_long_full_attention_prompt_never_builds_an_l_by_l_mask(monkeypatch) -> None:
    rows, length = 256, 2000
    monkeypatch.setattr(reference, "PREFILL_QUERY_ROWS", rows)
    masks, _ = _record_shapes(monkeypatch)
    _check([(length, length)], 0, None, seed=2)
    assert len(masks) == -(-length // rows)
    assert all(shape[-2] <= rows for shape in masks)  # rows × (keys up to the block's last query)
    assert max(math.prod(shape) for shape in masks) < length * length / 4


def test_chunk_after_a_long_cached_prefix_gathers_only_the_window(monkeypatch) -> None:
    """A 100-token chunk after 2,900 cached tokens on a 64-token window reads about (100 + 64) / 8 blocks
    of the cache, not 3,000 / 8."""
    rows, window, length, new = 32, 64, 3000, 100
    monkeypatch.setattr(reference, "PREFILL_QUERY_ROWS", rows)
    masks, tables = _record_shapes(monkeypatch)
    _check([(length, new)], window, None, seed=3)
    assert tables and all(shape[-1] <= (new + window) // BLOCK + 2 for shape in tables)
    assert max(math.prod(shape) for shape in masks) <= rows * (rows + window - 1)
