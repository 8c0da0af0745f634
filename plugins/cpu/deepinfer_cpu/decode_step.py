"""A Llama-family decoder stack for one decode row in one C call (``csrc/decode_step.c``).

A batch-1 decode step through the model's Python layers makes ~1,400 small torch ops and ~5,000 Python calls
around its 120 projections: ~5 ms of a ~20 ms float32 SmolLM2 token on the 2-core VM, the gap to llama.cpp
(docs/benchmarks.md, issue 36). ``DecodeStep`` hands the whole stack to the kernel instead: the projections
run the same GEMV as one-row calls of the ``onednn`` backend and attention the same kernel as ``cpu_paged``,
the norms, rope, SiLU and residual adds run in C between them, and Python makes one call per step.

The plan (the per-layer tensor pointers, float32 copies of the norm weights and biases) is built once per
``DenseDecoderStack`` and checked on every call against the tensors' addresses (and the copied ones' version
counters), so a parameter or cache re-bound to new storage, or a norm weight or bias written in place,
rebuilds it; the matrices and caches are read where they lie.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from deepinfer.interfaces import DenseDecoderStack
from deepinfer_cpu.cbuild import CSRC, build_library

SOURCES = (CSRC / "decode_step.c", CSRC / "gemv.c", CSRC / "paged_attention.c")
DTYPES = (torch.float32, torch.bfloat16)


class _Shape(ctypes.Structure):
    """``struct shape`` of ``decode_step.c``."""

    _fields_ = [(name, ctypes.c_int64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                    "intermediate", "block_size")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("bf16", ctypes.c_int32)]


@functools.cache
def _kernel() -> ctypes._CFuncPtr:
    fn = build_library(SOURCES).decode_step
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int]
    return fn


def fits(stack: DenseDecoderStack) -> bool:
    """Whether the kernel serves ``stack``: float32 or bf16 weights and plain caches of that dtype, contiguous."""
    dtype = stack.layers[0].qkv.dtype
    return dtype in DTYPES and all(
        t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
        for layer in stack.layers for t in (layer.qkv, layer.o_proj, layer.gate_up, layer.down, *layer.kv_cache)
    ) and all(len(layer.kv_cache) == 2 for layer in stack.layers)


class DecodeStep:
    """One model's stack, laid out for the kernel (module docstring)."""

    def __init__(self, stack: DenseDecoderStack, block_size: int) -> None:
        self.dtype = stack.layers[0].qkv.dtype
        self.block_size = block_size
        self.shape = _Shape(len(stack.layers), stack.hidden, stack.heads, stack.kv_heads, stack.head_dim,
                            stack.intermediate, block_size, stack.eps, stack.scale,
                            int(self.dtype == torch.bfloat16))
        # float32 copies the kernel reads (widening bf16 is exact); kept alive with the plan
        self.copies = [t.float().contiguous() for layer in stack.layers
                       for t in (layer.input_norm, layer.post_norm, layer.qkv_bias) if t is not None]
        copies = iter(self.copies)
        pointers = []
        for layer in stack.layers:
            input_norm, post_norm = next(copies), next(copies)
            bias = next(copies) if layer.qkv_bias is not None else None
            pointers += [input_norm.data_ptr(), layer.qkv.data_ptr(), bias.data_ptr() if bias is not None else None,
                         layer.o_proj.data_ptr(), post_norm.data_ptr(), layer.gate_up.data_ptr(),
                         layer.down.data_ptr(), layer.kv_cache[0].data_ptr(), layer.kv_cache[1].data_ptr()]
        self.plan = (ctypes.c_void_p * len(pointers))(*pointers)
        self.cos, self.sin = stack.rope_cos.float().contiguous(), stack.rope_sin_signed.float().contiguous()
        self.addresses = _addresses(stack)

    def current(self, stack: DenseDecoderStack, block_size: int) -> bool:
        """Whether this plan still points at ``stack``'s tensors (and the cache's block size)."""
        return self.block_size == block_size and self.addresses == _addresses(stack)

    def run(self, stack: DenseDecoderStack, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            seq_lens: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The residual stream after the last layer for the one row ``x [1, hidden]`` at ``positions[0]``
        (its key and value written at ``slots[0]``, its request's ``seq_lens[0]`` keys through the block table
        ``tables[0]``),
        and the inputs of ``stack.captured_layers``. Index tensors are int64 and contiguous."""
        x = x.contiguous()
        out = torch.empty_like(x)
        captured = {i: torch.empty_like(x) for i in stack.captured_layers}
        captures = None
        if captured:
            captures = (ctypes.c_void_p * (len(stack.layers) + 1))(
                *(captured[i].data_ptr() if i in captured else None for i in range(len(stack.layers) + 1)))
        failed = _kernel()(ctypes.byref(self.shape), self.plan, x.data_ptr(), out.data_ptr(), self.cos.data_ptr(),
                           self.sin.data_ptr(), positions.data_ptr(), slots.data_ptr(), seq_lens.data_ptr(),
                           tables.data_ptr(), captures, torch.get_num_threads())
        if failed:
            raise MemoryError("plugins.cpu decode step: the kernel could not allocate its buffers")
        return out, captured


def _addresses(stack: DenseDecoderStack) -> tuple[int, ...]:
    """Every tensor's address, and the version counter of those the plan copies."""
    return tuple(x for layer in stack.layers for x in (
        *(t.data_ptr() for t in (layer.qkv, layer.o_proj, layer.gate_up, layer.down, *layer.kv_cache)),
        *(v for t in (layer.input_norm, layer.post_norm, layer.qkv_bias) if t is not None
          for v in (t.data_ptr(), t._version))))
