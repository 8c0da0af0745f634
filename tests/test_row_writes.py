"""``kv/row_writes.write_rows``: the same rows as ``index_copy_`` on every layout it takes, eager and inside
a compiled function, where it writes a view of a larger pool in place (no functional copy of the part);
and ``sinkhorn_cells``, the compiled layers' Sinkhorn, against the tensor form."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kv.row_writes import write_rows
from deepinfer.model.deepseek_v4.hyper import sinkhorn_cells


def _expected(part: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    out = part.clone()
    out.reshape(-1, part.shape[-1])[rows] = src
    return out


@pytest.mark.parametrize("layout", ["flat", "paged", "strided"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_write_rows_writes_the_rows_in_place(layout: str, compiled: bool) -> None:
    pool = torch.zeros(3, 6, 5, 8)
    part = {"flat": pool[1].view(30, 8), "paged": pool[1], "strided": pool[1, :, :, 2:6]}[layout]
    rows = torch.tensor([4, 17, 29])
    src = torch.randn(3, part.shape[-1])
    expected = _expected(part, rows, src)
    write = torch.compile(write_rows, fullgraph=True) if compiled else write_rows
    write(part, rows, src)
    assert torch.equal(part, expected)
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0  # nothing outside the part


def test_write_rows_inside_a_compiled_layer_mutates_the_bound_part() -> None:
    pool = torch.zeros(2, 4, 4, 3)

    class Writer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.part = pool[1]

        def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            y = x * 2
            write_rows(self.part, rows, y)
            return y + 1

    writer = Writer()
    writer.compile(dynamic=True)
    x = torch.randn(2, 3)
    out = writer(x, torch.tensor([1, 14]))
    assert torch.equal(out, x * 2 + 1)
    assert torch.equal(pool[1].view(-1, 3)[[1, 14]], x * 2)
    assert pool[1].view(-1, 3).abs().sum(dim=-1).count_nonzero() == 2


def test_sinkhorn_cells_equals_the_tensor_form() -> None:
    """``HyperConnection.mixes``' eager rounds, written out here."""
    gen = torch.Generator().manual_seed(0)
    comb = torch.randn(7, 4, 4, generator=gen).softmax(dim=-1) + 1e-6
    expected = comb / (comb.sum(dim=-2, keepdim=True) + 1e-6)
    for _ in range(19):
        expected = expected / (expected.sum(dim=-1, keepdim=True) + 1e-6)
        expected = expected / (expected.sum(dim=-2, keepdim=True) + 1e-6)
    got = sinkhorn_cells(comb, 20, 1e-6)
    assert got.shape == comb.shape
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
