"""``onednn``: CPU GEMMs (op ``linear``) on weights packed once into oneDNN's blocked layout.

torch's ``F.linear`` hands a call of a few rows (a verification step's 6 query tokens, a batch of
decode rows) to a BLAS GEMM that re-packs the whole weight on every call; for the 113 MB tied LM head
of SmolLM2 that packing costs more than the multiply. oneDNN can pack a weight once
(``torch.ops.mkldnn._reorder_linear_weight``, the op Inductor's CPU freezing uses) and multiply any
number of rows against the packed copy (``_linear_pointwise``). Calls with fewer than ``min_rows``
rows run on the plain weight, kept row-major: one float32 row through ``gemv.py``'s kernel (31–39 GB/s on
this VM, against 11–25 for torch's matrix-vector product), anything else through ``F.linear``.

Which weights are packed: every weight the model lists in ``gemm_weights`` (at ``prepare_weight``)
and any other ``nn.Parameter`` on first use (the tied LM head, which must stay a plain embedding
table). Both copies are kept, so a packed weight costs its size again in host memory. A packed copy
is keyed by the weight's storage address, shape and strides and holds a reference to the weight, so
the address cannot be reused by another tensor while the entry lives; an in-place write to the weight
(its version counter moves) repacks it on the next call. Plain tensors that are not parameters
(temporaries) are never packed: they go to ``F.linear``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.interfaces import BackendCapabilities, DenseDecoderStack, ForwardContext
from deepinfer_cpu import decode_step
from deepinfer_cpu.gemv import fits, gemv


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

    def __init__(self, *, min_rows: int = 2, pack_rows: int = 16, fused_decode: bool = True) -> None:
        self.min_rows = min_rows
        self.pack_rows = pack_rows
        self.fused_decode = fused_decode
        dtypes = {torch.float32, torch.bfloat16} if _bf16_supported() else {torch.float32}
        self.capabilities = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset(dtypes))
        self._packed: dict[tuple[int, tuple[int, ...], tuple[int, ...]], _Packed] = {}
        self._steps: weakref.WeakKeyDictionary[DenseDecoderStack, decode_step.DecodeStep] = weakref.WeakKeyDictionary()
        self.fused_steps = 0  # steps served by decode_stack

    def available(self) -> bool:
        return onednn_available()

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The plain weight row-major (the one-row kernel reads it that way), packed for oneDNN."""
        plain = weight.contiguous()
        self._pack(plain)
        return plain

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows < self.min_rows or x.dtype != weight.dtype or not isinstance(weight, torch.nn.Parameter):
            return gemv(x, weight, bias) if rows == 1 and fits(x, weight) else F.linear(x, weight, bias)
        packed = self._lookup(weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def decode_stack(self, stack: DenseDecoderStack, x: torch.Tensor, ctx: ForwardContext
                     ) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
        """A step of one decode row through ``decode_step.py``'s kernel (``fused_decode``), when the run's
        attention is ``cpu_paged`` (the kernel attends as it does) and the stack's tensors fit the kernel;
        None otherwise (``GemmBackend``'s contract, ``deepinfer/interfaces.py``)."""
        if (not self.fused_decode or x.shape[0] != 1 or ctx.num_decodes != 1
                or getattr(ctx.backends["paged_attention"], "name", None) != "cpu_paged"):
            return None
        index = (ctx.positions, ctx.slot_mapping, ctx.seq_lens, ctx.block_tables)
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in index):
            return None
        step = self._steps.get(stack)
        if step is None or not step.current(stack, ctx.block_size):
            if not decode_step.fits(stack):
                return None
            step = self._steps[stack] = decode_step.DecodeStep(stack, ctx.block_size)
        self.fused_steps += 1
        return step.run(stack, x, *index)

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
