"""The device-side token layouts (``layout.py``): every pair lands in exactly one row of its expert's
blocks, blocks never mix experts, and the static bounds hold for skewed and sparse routing."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_moe.layout import contiguous_rows, masked_slots, max_blocks, pair_blocks, pair_view, sorted_blocks
from moe_cases import ROUTINGS, make_routing


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize(("tokens", "block_m"), [(1, 16), (7, 16), (50, 32), (300, 64)])
def test_sorted_blocks_put_every_pair_once_in_a_block_of_its_expert(routing: str, tokens: int, block_m: int) -> None:
    experts, top_k = 16, 4
    ids, _ = make_routing(tokens, experts, top_k, routing, seed=tokens)
    layout = sorted_blocks(ids, experts, block_m)
    num_pairs = tokens * top_k
    assert layout.num_blocks == max_blocks(num_pairs, experts, block_m)
    rows = layout.pairs.view(layout.num_blocks, block_m).long()
    valid = rows < num_pairs
    assert sorted(rows[valid].tolist()) == list(range(num_pairs))  # each pair exactly once
    flat = ids.reshape(-1)
    for b in range(layout.num_blocks):
        expert = int(layout.block_expert[b])
        block_pairs = rows[b][valid[b]]
        if expert < 0:
            assert block_pairs.numel() == 0
        else:
            assert block_pairs.numel() > 0 and bool(valid[b, 0])  # blocks fill from their first row
            assert torch.all(flat[block_pairs] == expert)
    used = layout.block_expert[layout.block_expert >= 0]
    expected = sum(-(-int(c) // block_m) for c in torch.bincount(flat, minlength=experts))
    assert used.numel() == expected  # no more blocks than the counts need


def test_pair_blocks_hold_one_pair_each() -> None:
    ids, _ = make_routing(3, 8, 2, "uniform", seed=3)
    layout = pair_blocks(ids, 16)
    rows = layout.pairs.view(6, 16)
    assert rows[:, 0].tolist() == list(range(6)) and torch.all(rows[:, 1:] == 6)
    assert layout.block_expert.tolist() == ids.reshape(-1).tolist()


@pytest.mark.parametrize("routing", ROUTINGS)
def test_contiguous_rows_align_experts_and_mark_padding(routing: str) -> None:
    ids, _ = make_routing(90, 16, 4, routing, seed=5)
    layout, row_expert = contiguous_rows(ids, 16, 32)
    valid = layout.pairs < 360
    assert torch.all(row_expert[~valid] == -1)
    assert torch.all(row_expert[valid] == ids.reshape(-1)[layout.pairs[valid].long()])
    starts = [i for i in range(1, row_expert.numel()) if row_expert[i] >= 0 and row_expert[i] != row_expert[i - 1]]
    assert all(s % 32 == 0 for s in starts)  # each expert's run begins on an alignment boundary


@pytest.mark.parametrize("routing", ROUTINGS)
def test_masked_slots_give_each_expert_its_pairs_in_order(routing: str) -> None:
    tokens, experts, top_k = 20, 8, 3
    ids, _ = make_routing(tokens, experts, top_k, routing, seed=9)
    slots = masked_slots(ids, experts)
    assert slots.m_max == 64
    flat = ids.reshape(-1)
    assert slots.counts.tolist() == torch.bincount(flat, minlength=experts).tolist()
    expert, row = slots.slot // slots.m_max, slots.slot % slots.m_max
    assert torch.all(expert == flat)
    assert len(set(slots.slot.tolist())) == flat.numel()
    assert torch.all(row < slots.counts[expert].long())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"),
                         [(1, 64, 6, 16), (5, 64, 6, 16), (16, 64, 6, 16), (64, 64, 8, 32), (64, 64, 6, 64),
                          (16, 256, 8, 16), (3, 256, 8, 16), (40, 16, 4, 32)])
def test_small_sorted_blocks_equal_the_torch_layout(routing: str, tokens: int, experts: int, top_k: int,
                                                    block_m: int) -> None:
    """The one-launch layout (``layout_kernel.py``) is ``sorted_blocks`` exactly: the same rows, the same
    block experts (CPU through Triton's interpreter; CUDA in ``test_moe_gpu.py``)."""
    from deepinfer_moe.layout_kernel import fits_small_layout, small_sorted_blocks

    ids, _ = make_routing(tokens, experts, top_k, routing, seed=tokens + experts)
    assert fits_small_layout(ids.numel(), experts)
    expected = sorted_blocks(ids, experts, block_m)
    layout = small_sorted_blocks(ids, experts, block_m)
    assert torch.equal(layout.pairs, expected.pairs)
    assert torch.equal(layout.block_expert, expected.block_expert)


def test_small_layout_bound_and_pair_view() -> None:
    from deepinfer_moe.layout_kernel import fits_small_layout

    assert fits_small_layout(16 * 6, 64) and fits_small_layout(16 * 8, 256)
    assert not fits_small_layout(64 * 8, 256) and not fits_small_layout(0, 64)
    ids, _ = make_routing(3, 8, 2, "uniform", seed=3)
    view = pair_view(ids, 16)
    assert view.one_pair_per_block and view.num_blocks == 6 and view.num_pairs == 6
    assert view.block_expert.tolist() == pair_blocks(ids, 16).block_expert.tolist()
