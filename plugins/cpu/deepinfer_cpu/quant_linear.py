"""``cpu_int8`` / ``cpu_q4_1``: quantized GEMMs (op ``linear``) for ``model.quantization``.

A decode step of a small model on CPU streams every GEMM weight once per step: SmolLM2-135M reads 540 MB of
float32 weights per token, so batch-1 decode runs at memory speed. These backends keep each weight the model
lists in ``gemm_weights`` quantized and multiply it in ``csrc/quant_linear.c``, with the inputs as
``plugins.cpu.quant_inputs`` says: ``int8`` (the default) rounds each block of 32 inputs of a row to int8
codes of step ``max|x| / 127`` and takes integer dot products against the weight's codes (AVX512-VNNI where
the CPU has it), as llama.cpp multiplies its Q4_1 / Q8_0 weights; ``float32`` (weight-only quantization)
converts the weights to float32 in registers (one row) or in cache, four output rows at a time (several).
The formats:

* ``int8`` (backend ``cpu_int8``): symmetric int8 with one float32 scale per output row,
  ``scale = max|w_row| / 127`` — a quarter of the float32 bytes.
* ``q4_1`` (backend ``cpu_q4_1``): llama.cpp's Q4_1 layout, blocks of 32 inputs with a float16 step ``d`` and
  minimum ``m`` each (``w = d·q + m``, ``q`` in 0..15, ``d = (max - min) / 15``) — 5 bits per weight, the
  bytes of a GGUF Q4_1 tensor. The LM head (the weight with ``vocab_size`` rows) is
  kept in 8-bit blocks of 32 (llama.cpp's Q8_0: ``d = max|w| / 127``), as llama.cpp's Q4_1 files keep it; a
  model with another GEMM weight of exactly ``vocab_size`` rows gets that one in 8 bits too (more precise,
  never less).
  A weight that came from a GGUF Q4_1 (Q8_0) tensor — the SmolLM2 package's — is re-derived block by block
  from its float32 values: each block's minimum and maximum are its ``q = 0`` and ``q = 15`` values, so the
  blocks, steps and minima come back to float32 rounding (checked by ``tests/test_quant_linear.py``) and the
  model computes with the file's own 4-bit weights.

``prepare_weight`` returns the weight *rounded to its format* (its float32 values after quantization), so
every other reader of the parameter — the embedding lookup of a tied LM head, calls that take torch's path —
sees the same model the kernel computes with. Calls with at least ``dense_rows`` rows (8) run oneDNN's
float32 GEMM on those rounded values, packed once (the ``onednn`` backend; torch's ``F.linear`` without
oneDNN): there the multiply, not the weight stream, dominates, and oneDNN's register-blocked GEMM outruns
this kernel's loops (docs/benchmarks.md). Under ``quant_inputs=int8`` those calls get their inputs rounded
first (``quantize_inputs``, the kernel's codes), so every call — prefill, a decode step of any size, a
verification step — multiplies the same rounded inputs by the same weights, up to the order of the sums
(within the kernel a row's result does not even depend on the other rows of the call). The float32 copy
stays in memory beside the quantized one (the tied embedding table needs it), so these backends save memory
bandwidth per step, not memory.

Weights are keyed like ``onednn``'s packed copies (storage address, shape, strides, with a reference held); an
in-place write to a weight re-quantizes it on the next call. A tensor that was never prepared (a temporary, or
a parameter the model does not list in ``gemm_weights``) runs torch's float32 GEMM unquantized.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.interfaces import BackendCapabilities
from deepinfer_cpu.cbuild import CSRC, build_library, compiler
from deepinfer_cpu.decode_step import KINDS, FusedDecoder, Projection
from deepinfer_cpu.huge_pages import HugePageArena
from deepinfer_cpu.onednn import OneDNNGemmBackend, onednn_available

BLOCK = 32  # inputs per Q4_1 / Q8_0 block
FORMATS = ("int8", "q4_1")
INPUT_MODES = ("float32", "int8")  # what the quantized kernels multiply the weights with


@functools.cache
def load_kernel(march: str = "native") -> ctypes.CDLL:
    """``csrc/quant_linear.c``, built into the cache on first use (``march``: ``cbuild.build_library``)."""
    lib = build_library(CSRC / "quant_linear.c", march)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.linear_int8_f32.restype = ctypes.c_int
    lib.linear_int8_f32.argtypes = [ptr] * 5 + [i64] * 4 + [ctypes.c_int]
    lib.linear_q4_1_f32.restype = ctypes.c_int
    lib.linear_q4_1_f32.argtypes = [ptr] * 6 + [i64] * 3 + [ctypes.c_int]
    lib.linear_int8_q8.restype = ctypes.c_int
    lib.linear_int8_q8.argtypes = lib.linear_int8_f32.argtypes
    lib.linear_q4_1_q8.restype = ctypes.c_int
    lib.linear_q4_1_q8.argtypes = lib.linear_q4_1_f32.argtypes
    return lib


@dataclass(frozen=True)
class Int8Weight:
    """``w[n, k] = scale[n, k // group] · q[n, k]``: ``q`` int8 ``[N, K]``, ``scale`` float32 ``[N, K / group]``."""

    q: torch.Tensor
    scale: torch.Tensor
    group: int

    def dequantize(self) -> torch.Tensor:
        """The float32 values ``[N, K]``."""
        n, k = self.q.shape
        return (self.q.float().view(n, k // self.group, self.group) * self.scale.unsqueeze(-1)).view(n, k)


@dataclass(frozen=True)
class Q41Weight:
    """llama.cpp's Q4_1: ``w[n, 32b + j] = d[n, b] · q + m[n, b]``, ``q`` the low nibble of ``qs[n, 16b + j]``
    for ``j < 16``, the high nibble of ``qs[n, 16b + j - 16]`` otherwise; ``qs`` uint8 ``[N, K / 2]``,
    ``d`` and ``m`` float16 ``[N, K / 32]``."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 values ``[N, K]``."""
        n, blocks = self.d.shape
        packed = self.qs.view(n, blocks, BLOCK // 2)
        q = torch.cat([packed & 15, packed >> 4], dim=-1).float()
        return (q * self.d.float().unsqueeze(-1) + self.m.float().unsqueeze(-1)).view(n, blocks * BLOCK)


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> Int8Weight:
    """Symmetric int8 of ``weight [N, K]``, one scale per ``group`` inputs of a row (None: per row):
    ``scale = max|w| / 127``, ``q = round(w / scale)``; an all-zero group gets scale 0."""
    n, k = weight.shape
    group = k if group is None else group
    if k % group:
        raise ValueError(f"int8 quantization in groups of {group} needs an input width divisible by it, got {k}")
    w = weight.detach().float().reshape(n, k // group, group)
    scale = w.abs().amax(dim=-1) / 127.0
    q = torch.round(w / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)).clamp_(-127, 127)
    return Int8Weight(q.to(torch.int8).reshape(n, k).contiguous(), scale.contiguous(), group)


def quantize_q4_1(weight: torch.Tensor) -> Q41Weight:
    """Q4_1 of ``weight [N, K]`` (``K`` a multiple of 32): per block ``m = min`` and ``d = (max - min) / 15``,
    both rounded to float16, ``q = round((w - m) / d)`` in 0..15 with the rounded ones; a constant block gets
    ``d = 0``. Values beyond float16's range are refused."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"q4_1 quantization needs an input width divisible by {BLOCK}, got {k}")
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    d, m = ((high - low) / 15.0).half(), low.half()
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise ValueError("q4_1 quantization needs weights within float16's range (|w| <= 65504)")
    step = d.float()
    q = torch.round((w - m.float().unsqueeze(-1)) / torch.where(step > 0, step, 1.0).unsqueeze(-1))
    q = q.clamp_(0, 15).to(torch.uint8)
    qs = q[..., : BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return Q41Weight(qs.reshape(n, k // 2).contiguous(), d.contiguous(), m.contiguous())


def quantize_inputs(x: torch.Tensor) -> torch.Tensor:
    """The float32 values the ``int8`` input mode computes with: each block of 32 inputs of a row rounded to
    int8 codes of step ``max|x| / 127`` (llama.cpp's Q8 activations; ``x [..., K]``, ``K`` a multiple of 32),
    with the kernel's own float32 operations, so the codes are the kernel's."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    codes = torch.round(blocks * torch.where(amax > 0, 127.0 / amax, 0.0))  # the kernel's float32 operations
    return (codes * (amax / 127.0)).reshape(x.shape)


class QuantizedLinear:
    """A quantized weight bound to its C kernel: ``layer(x, bias)`` is ``x [..., K] @ wᵀ (+ bias)``, ``x``
    float32 on the CPU, returning ``[..., N]``. ``inputs="int8"`` quantizes ``x`` in blocks of 32 and
    multiplies with integer dot products (``quantize_inputs``; ``K`` a multiple of 32), ``"float32"``
    multiplies ``x`` as it is. The kernel and the weight's pointers are chosen once: a decode step makes ~120
    of these calls, so a call does little more than allocate its output."""

    def __init__(self, weight: Int8Weight | Q41Weight, inputs: str = "float32", *, march: str = "native") -> None:
        q8 = inputs == "int8"
        if isinstance(weight, Int8Weight):
            n, k = weight.q.shape
            operands, tail, fmt = (weight.q, weight.scale), (weight.group,), "int8"
        else:
            n, k = weight.d.shape[0], weight.qs.shape[1] * 2
            operands, tail, fmt = (weight.qs, weight.d, weight.m), (), "q4_1"
        kind = f"{fmt}_{'q8' if q8 else 'f32'}"  # the C entry point linear_<kind>, and decode_step.KINDS'
        run = getattr(load_kernel(march), f"linear_{kind}")
        if inputs not in INPUT_MODES or (q8 and k % BLOCK):
            raise ValueError(f"quantized linear: inputs must be one of {list(INPUT_MODES)} (int8 needs a width "
                             f"divisible by {BLOCK}), got {inputs!r} at width {k}")
        if q8 and isinstance(weight, Int8Weight) and weight.group % BLOCK:
            raise ValueError(f"quantized linear: int8 inputs need weight groups of a multiple of {BLOCK} inputs, "
                             f"got {weight.group}")
        self.weight, self.inputs, self.n, self.k = weight, inputs, n, k
        pointers = tuple(t.data_ptr() for t in operands)
        self._run = lambda x, bias, out, rows, threads: run(x, *pointers, bias, out, rows, n, k, *tail, threads)
        # the same kernel for the fused decode step (decode_step.py)
        self.projection = Projection(KINDS.index(kind), tail[0] if tail else 0, *pointers)
        self.operands = operands

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32 or x.shape[-1] != self.k:
            raise ValueError(f"quantized linear takes float32 inputs of width {self.k}, got {x.dtype} "
                             f"{tuple(x.shape)}")
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty((*x.shape[:-1], self.n), dtype=torch.float32)
        bias_arg = None
        if bias is not None:
            bias = bias.detach().float().contiguous()
            bias_arg = bias.data_ptr()
        if self._run(x.data_ptr(), bias_arg, out.data_ptr(), x.numel() // self.k, torch.get_num_threads()):
            raise MemoryError("plugins.cpu quantized linear: the kernel could not allocate its buffers")
        return out


def quantized_linear(x: torch.Tensor, weight: Int8Weight | Q41Weight, bias: torch.Tensor | None = None,
                     inputs: str = "float32") -> torch.Tensor:
    """``QuantizedLinear(weight, inputs)(x, bias)``: one call, for callers without a kept layer."""
    return QuantizedLinear(weight, inputs)(x, bias)


@dataclass
class _Entry:
    weight: torch.Tensor  # the rounded float32 weight (kept: its address keys the entry)
    version: int
    layer: QuantizedLinear


class QuantizedGemmBackend:
    """Op ``linear`` on weights quantized to ``fmt`` (``int8`` or ``q4_1``; module docstring). Serves the runs
    whose ``model.quantization`` is ``fmt`` (the plugin offers it only to those); ``head_rows`` is the
    vocabulary size, whose weight (the LM head) ``q4_1`` keeps in 8-bit blocks; ``inputs`` is
    ``plugins.cpu.quant_inputs`` (``quantized_linear``)."""

    priority = 20  # above onednn (10): under model.quantization the quantizing backend is the one that fits

    def __init__(self, fmt: str, *, head_rows: int | None = None, dense_rows: int = 8,
                 inputs: str = "int8", fused_decode: bool = True, huge_pages: bool = True) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"model.quantization: no CPU kernel for {fmt!r}; choose one of {list(FORMATS)}")
        if inputs not in INPUT_MODES:
            raise ValueError(f"plugins.cpu.quant_inputs must be one of {list(INPUT_MODES)}, got {inputs!r}")
        self.inputs = inputs
        self.format = fmt
        self.name = f"cpu_{fmt}"
        self.ops = frozenset({"linear"})
        self.head_rows = head_rows
        self.dense_rows = dense_rows
        self.capabilities = BackendCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))
        # min_rows=1: every call handed to it has dense_rows rows or more
        self.dense = (OneDNNGemmBackend(min_rows=1, fused_decode=False, fused_draft=False, huge_pages=False)
                      if onednn_available() else None)
        self.arena = HugePageArena() if huge_pages else None  # where the quantized weights live (huge_pages.py)
        self._entries: dict[tuple[int, tuple[int, ...], tuple[int, ...]], _Entry] = {}
        if fused_decode:  # GemmBackend's optional decode_stack: the steps its kernels take (fewer than dense_rows)
            self.decode_stack = FusedDecoder(self._projection, max_rows=self.kernel_rows, linear=self.linear)

    def available(self) -> bool:
        return compiler() is not None

    def kernel_rows(self, dtype: torch.dtype) -> int:
        """The most rows a call runs the quantized kernels for (``dense_rows`` − 1), whatever the dtype."""
        return self.dense_rows - 1

    def row_breaks(self, dtype: torch.dtype) -> list[int]:
        """``GemmBackend.row_breaks``: the quantized kernels (and the fused steps) up to ``kernel_rows``."""
        return [self.kernel_rows(dtype)]

    def quantize(self, weight: torch.Tensor) -> Int8Weight | Q41Weight:
        """``weight [N, K]`` in this backend's format (8-bit blocks for the LM head under ``q4_1``)."""
        if weight.dim() != 2:
            raise ValueError(f"model.quantization={self.format!r}: a GEMM weight must be 2-D, "
                             f"got {tuple(weight.shape)}")
        if self.inputs == "int8" and weight.shape[1] % BLOCK:
            raise ValueError(f"plugins.cpu.quant_inputs='int8' needs GEMM input widths divisible by {BLOCK}, got a "
                             f"weight of shape {tuple(weight.shape)} (set plugins.cpu.quant_inputs=float32)")
        if self.format == "int8":
            return quantize_int8(weight)
        if weight.shape[0] == self.head_rows:
            return quantize_int8(weight, BLOCK)
        return quantize_q4_1(weight)

    def prepare_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight rounded to the format (float32, column-major as torch's GEMM reads it fastest); its
        quantized form is kept for ``linear`` (on huge pages with ``huge_pages``)."""
        quantized = self.quantize(weight)
        if self.arena is not None:
            arena = self.arena
            quantized = (Int8Weight(arena.place(quantized.q), arena.place(quantized.scale), quantized.group)
                         if isinstance(quantized, Int8Weight) else
                         Q41Weight(arena.place(quantized.qs), arena.place(quantized.d), arena.place(quantized.m)))
        rounded = quantized.dequantize().t().contiguous().t()
        if self.dense is not None:
            rounded = self.dense.prepare_weight(rounded)
        self._entries[self._key(rounded)] = _Entry(rounded, rounded._version, QuantizedLinear(quantized, self.inputs))
        return rounded

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        entry = self._entries.get(self._key(weight))
        if entry is None or x.dtype != torch.float32:
            return F.linear(x, weight, bias)  # a temporary: never quantized
        if rows >= self.dense_rows:  # many rows: the multiply dominates; the inputs rounded as the kernel rounds them
            if self.inputs == "int8":
                x = quantize_inputs(x)
            return F.linear(x, weight, bias) if self.dense is None else self.dense.linear(x, weight, bias)
        return self._current(weight, entry).layer(x, bias)

    def _current(self, weight: torch.Tensor, entry: _Entry) -> _Entry:
        if entry.version != weight._version:  # written in place since: quantize the new values
            entry = _Entry(entry.weight, weight._version, QuantizedLinear(self.quantize(weight), self.inputs))
            self._entries[self._key(weight)] = entry
        return entry

    def _projection(self, weight: torch.Tensor) -> tuple[Projection, tuple[torch.Tensor, ...]] | None:
        """A prepared weight's quantized kernel, for the fused decode step (``decode_step.ProjectionOf``)."""
        entry = self._entries.get(self._key(weight))
        if entry is None:
            return None
        layer = self._current(weight, entry).layer
        return layer.projection, layer.operands

    @staticmethod
    def _key(weight: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        return weight.data_ptr(), tuple(weight.shape), tuple(weight.stride())
