"""``onednn``: CPU GEMMs (op ``linear``) on weights packed once into oneDNN's blocked layout.

torch's ``F.linear`` hands a call of a few rows (a verification step's 6 query tokens, a batch of
decode rows) to a BLAS GEMM that re-packs the whole weight on every call; for the 113 MB tied LM head
of SmolLM2 that packing costs more than the multiply. oneDNN can pack a weight once
(``torch.ops.mkldnn._reorder_linear_weight``, the op Inductor's CPU freezing uses) and multiply any
number of rows against the packed copy (``_linear_pointwise``). Calls with fewer than ``min_rows``
rows run on the plain weight, kept row-major: float32 and bf16 rows through ``gemv.py``'s kernel (~55 GB/s on
this VM, against 11–25 for torch's matrix-vector product; each row summed as if alone), anything else through
``F.linear``.

Which weights are packed: every weight the model lists in ``gemm_weights`` (at ``prepare_weight``)
and any other ``nn.Parameter`` on first use (the tied LM head, which must stay a plain embedding
table). Both copies are kept, so a packed weight costs its size again in host memory. A packed copy
is keyed by the weight's storage address, shape and strides and holds a reference to the weight, so
the address cannot be reused by another tensor while the entry lives; an in-place write to the weight
(its version counter moves) repacks it on the next call. Plain tensors that are not parameters
(temporaries) are never packed: they go to ``F.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.interfaces import BackendCapabilities
from deepinfer_cpu.decode_step import FusedDecoder, plain_projection
from deepinfer_cpu.draft_step import FusedDrafter
from deepinfer_cpu.gemv import amx_available, fits, gemv
from deepinfer_cpu.huge_pages import HugePageArena

FLOAT32_MIN_ROWS = 13  # plugins.cpu.min_rows when None (config.py): float32, the GEMV up to 12 rows
BF16_MIN_ROWS = 7  # bfloat16 without AMX tiles
AMX_MIN_ROWS = 33  # bfloat16 with AMX tiles: the GEMV takes up to 32 rows in one pass


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its packed-linear ops."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _bf16_supported() -> bool:
    """oneDNN's bf16 packing needs AVX512-BF16-class instructions (it refuses otherwise)."""
    return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass
class _Packed:
    weight: torch.Tensor  # the plain weight (kept: its address keys the entry and must not be reused)
    version: int  # the weight's version counter when it was packed
    packed: torch.Tensor  # oneDNN's blocked copy


class OneDNNGemmBackend:
    """op ``linear`` on CPU through oneDNN's packed weights (module docstring)."""

    name = "onednn"
    priority = 10
    ops = frozenset({"linear"})

    def __init__(self, *, min_rows: int | None = None, pack_rows: int = 16, fused_decode: bool = True,
                 fused_draft: bool = True, huge_pages: bool = True) -> None:
        self.min_rows = min_rows
        self.pack_rows = pack_rows
        dtypes = {torch.float32, torch.bfloat16} if _bf16_supported() else {torch.float32}
        self.capabilities = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset(dtypes))
        self._packed: dict[tuple[int, tuple[int, ...], tuple[int, ...]], _Packed] = {}
        self.arena = HugePageArena() if huge_pages else None  # where prepared weights live (huge_pages.py)
        if fused_decode:  # GemmBackend's optional decode_stack: a Llama-family stack in C, for the GEMV's steps
            self.decode_stack = FusedDecoder(plain_projection, max_rows=self.gemv_rows, linear=self.linear)
        if fused_draft:  # and its optional draft_context / draft_block: a block drafter's passes in C, as many rows
            drafter = FusedDrafter(plain_projection, max_rows=self.gemv_rows)
            self.draft_context, self.draft_block = drafter.draft_context, drafter.draft_block

    def min_rows_for(self, dtype: torch.dtype) -> int:
        """The fewest rows a call of ``dtype`` runs oneDNN for (``plugins.cpu.min_rows``; None: 13 for float32, 33
        for bfloat16 where the GEMV has AMX tiles, which take up to 32 rows in one pass over the weight, else 7)."""
        if self.min_rows is not None:
            return self.min_rows
        if dtype == torch.bfloat16:
            return AMX_MIN_ROWS if amx_available() else BF16_MIN_ROWS
        return FLOAT32_MIN_ROWS

    def gemv_rows(self, dtype: torch.dtype) -> int:
        """The most rows a call of ``dtype`` runs the GEMV for (``min_rows_for`` − 1)."""
        return self.min_rows_for(dtype) - 1

    def row_breaks(self, dtype: torch.dtype) -> list[int]:
        """``GemmBackend.row_breaks``: the GEMV (and the fused steps) up to ``gemv_rows``, oneDNN after."""
        return [self.gemv_rows(dtype)]

    def available(self) -> bool:
        return onednn_available()

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The plain weight row-major (the GEMV reads it that way; on huge pages with
        ``huge_pages``), packed for oneDNN."""
        plain = weight.contiguous() if self.arena is None else self.arena.place(weight)
        self._pack(plain)
        return plain

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (rows < self.min_rows_for(weight.dtype) or x.dtype != weight.dtype
                or not isinstance(weight, torch.nn.Parameter)):
            return gemv(x, weight, bias) if rows and fits(x, weight) else F.linear(x, weight, bias)
        packed = self._lookup(weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    @staticmethod
    def _key(weight: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        return weight.data_ptr(), tuple(weight.shape), tuple(weight.stride())

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        plain = weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(plain, self.pack_rows)
        self._packed[self._key(plain)] = _Packed(plain, plain._version, packed)
        return packed

    def _lookup(self, weight: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(self._key(weight))
        if entry is None or entry.version != weight._version:
            return self._pack(weight)
        return entry.packed
