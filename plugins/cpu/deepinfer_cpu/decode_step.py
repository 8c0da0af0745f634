"""A Llama-family decoder stack over a step in one C call (``csrc/decode_step.c``).

A batch-1 decode step through the model's Python layers makes ~1,400 small torch ops and ~5,000 Python calls
around its 120 projections: ~5 ms of a ~20 ms float32 SmolLM2 token on the 2-core VM, the gap to llama.cpp
(docs/benchmarks.md, issue 36). ``FusedDecoder`` hands the whole stack to the kernel instead: each projection
runs the kernel its GEMM backend runs for those rows (the ``onednn`` backend's GEMV, or the ``cpu_int8`` /
``cpu_q4_1`` quantized kernels), attention the ``cpu_paged`` kernel, and the norms, rope, SiLU and residual
adds run in C between them: Python makes one call per step.

Which steps go through the kernels: those of at most ``max_rows`` rows in all (the GEMM backend's choice: the
rows its own kernels take — the ``onednn`` backend's GEMV those of fewer than ``min_rows`` rows, the quantized
backends' kernels those of fewer than ``quant_dense_rows``) whose requests' rows ``cpu_paged``'s kernel takes
(``paged_attention.kernel_takes``). A quantized run with ``quant_inputs: int8`` rounds every projection's inputs to
int8, so a last-bit difference between two ways of computing a norm can move a code and then a greedy token:
serving every step its kernels serve (decode rows, a request's verification rows, short prompt chunks) keeps one
way for all of them, and speculative decoding's tokens equal plain decoding's there as they did through the
layers.

The other steps (prompt chunks, batches of more rows) run the same C loop with the projections called back into
the backend's ``linear`` (oneDNN's GEMMs) and, for a chunk longer than the kernel takes, attention called back
into the attention backend (the core's SDPA); the loops between the calls run on every thread and read and write
the calls' rows in the model dtype where they lie. Through the torch layers a 4 × 512-token bf16 SmolLM2 prompt
step spent ~215 of its ~500 ms in ~25 elementwise torch ops a layer (conversions, norms, rope, SiLU); here
~110 ms (docs/benchmarks.md, issue 36).

The plan (per layer the kernels' pointers, float32 copies of the norm weights and biases) is built once per
``DenseDecoderStack`` and checked on every call against the tensors' addresses and the weights' version
counters (``Stamp``), so a parameter or cache re-bound to new storage, or a weight written in place (which a
quantized backend re-quantizes), rebuilds it.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import weakref
from collections import deque
from collections.abc import Callable, Sequence

import torch

from deepinfer.interfaces import DenseDecoderStack, ForwardContext
from deepinfer_cpu.cbuild import CSRC, build_library
from deepinfer_cpu.paged_attention import as_int64, kernel_takes

SOURCES = (CSRC / "decode_step.c", CSRC / "gemv.c", CSRC / "paged_attention.c", CSRC / "quant_linear.c")
# ``enum kind`` of stack_ops.h
KINDS = ("plain_f32", "plain_bf16", "int8_f32", "int8_q8", "q4_1_f32", "q4_1_q8")
# struct caller's call: (weight id or layer, rows, input address) -> 0, or nonzero when it failed
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)


class Projection(ctypes.Structure):
    """``struct projection``: a weight as its kernel takes it, ``kind`` an index into ``KINDS``; ``a``, ``b``,
    ``c`` the format's tensors (plain: the matrix; int8: codes, scales, with ``group``; q4_1: nibbles, steps,
    minima)."""

    _fields_ = [("kind", ctypes.c_int64), ("group", ctypes.c_int64),
                ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("c", ctypes.c_void_p)]


# A GEMM backend's answer for one weight: its Projection, and the tensors it points into (kept alive).
ProjectionOf = Callable[[torch.Tensor], tuple[Projection, tuple[torch.Tensor, ...]] | None]
# A GEMM backend's op ``linear(x, weight, bias)``.
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def plain_projection(weight: torch.Tensor) -> tuple[Projection, tuple[torch.Tensor, ...]] | None:
    """A row-major float32 or bf16 weight, read where it lies (``gemv.c``)."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_contiguous():
        return None
    return Projection(KINDS.index("plain_bf16" if weight.dtype == torch.bfloat16 else "plain_f32"), 0,
                      weight.data_ptr()), (weight,)


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("qkv", Projection), ("o_proj", Projection), ("gate_up", Projection), ("down", Projection),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p)]


class _Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                    "intermediate", "block_size")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("bf16", ctypes.c_int32)]


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("tokens", "requests", "table_width")] + [
        (name, ctypes.c_void_p) for name in ("positions", "slots", "seq_lens", "starts", "tables", "projection",
                                             "attention", "workspace")]


class _Caller(ctypes.Structure):
    """``struct caller``: ``call(id, rows, input)`` computes and points ``out`` at its result; attention reads
    ``q``, ``k``, ``v``."""

    _fields_ = [("call", _CALLBACK)] + [(name, ctypes.c_void_p) for name in ("out", "q", "k", "v")]


@functools.cache
def _library() -> ctypes.CDLL:
    lib = build_library(SOURCES)
    lib.decode_step.restype = ctypes.c_int
    lib.decode_step.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int]
    lib.decode_step_workspace.restype = ctypes.c_int64
    lib.decode_step_workspace.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


class DecodeStep:
    """One model's stack laid out for the kernel (module docstring); ``build`` gives None when a weight or
    cache does not fit it. ``linear``: the GEMM backend's op, for the steps its kernels do not take."""

    def __init__(self, stack: DenseDecoderStack, block_size: int, layers: list[_Layer],
                 kept: list[torch.Tensor], linear: Linear) -> None:
        self.block_size = block_size
        self.layers = (_Layer * len(layers))(*layers)
        self.kept = kept  # the tensors the plan points into
        self.dtype = dtype = stack.layers[0].kv_cache[0].dtype  # the model's and its caches'
        self.shape = _Shape(len(layers), stack.hidden, stack.heads, stack.kv_heads, stack.head_dim,
                            stack.intermediate, block_size, stack.eps, stack.scale, int(dtype == torch.bfloat16))
        self.cos, self.sin = stack.rope_cos.float().contiguous(), stack.rope_sin_signed.float().contiguous()
        self.final_norm = stack.final_norm.float().contiguous()
        self.stamp = Stamp.of(stack)
        self.linear = linear
        # for the steps of more rows than the kernels take: the projections (id 4 · layer + 0 qkv, 1 o_proj,
        # 2 gate_up, 3 down) through `linear`, attention through the attention backend (callbacks, below)
        self.gemms = [(w, b) for layer in stack.layers for w, b in (
            (layer.qkv, layer.qkv_bias), (layer.o_proj, None), (layer.gate_up, None), (layer.down, None))]
        self._projection = _Caller(_CALLBACK(self._project))
        self._attention = _Caller(_CALLBACK(self._attend))
        self._workspace = torch.empty(0, dtype=torch.uint8)  # decode_step_workspace's bytes, kept across steps
        self._buffers: dict[str, torch.Tensor] = {}  # attention's q, k, v
        # what the callbacks pointed the kernel at: the latest two (attention's output is o_proj's input)
        self._results: deque[torch.Tensor] = deque(maxlen=2)
        self._stack: DenseDecoderStack | None = None  # the stack and step of the call in progress
        self._ctx: ForwardContext | None = None
        self._error: BaseException | None = None

    @classmethod
    def build(cls, stack: DenseDecoderStack, block_size: int, projection: ProjectionOf,
              linear: Linear) -> DecodeStep | None:
        dtype = stack.layers[0].kv_cache[0].dtype
        if dtype not in (torch.float32, torch.bfloat16):
            return None
        layers, kept = [], []
        for layer in stack.layers:
            caches = layer.kv_cache
            if len(caches) != 2 or any(c.dtype != dtype or not c.is_contiguous() or c.device.type != "cpu"
                                       for c in caches):
                return None
            projections = [projection(w) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            if any(p is None for p in projections):
                return None
            vectors = [t.float().contiguous() if t is not None else None
                       for t in (layer.input_norm, layer.post_norm, layer.qkv_bias, layer.q_norm, layer.k_norm)]
            kept += [t for t in vectors if t is not None] + [t for p in projections for t in p[1]]
            pointers = [t.data_ptr() if t is not None else None for t in vectors]
            layers.append(_Layer(*pointers[:3], *(p[0] for p in projections), caches[0].data_ptr(),
                                 caches[1].data_ptr(), *pointers[3:]))
        return cls(stack, block_size, layers, kept, linear)

    def kernel_attends(self, max_query_len: int) -> bool:
        """Whether ``cpu_paged``'s kernel takes a step whose requests bring at most ``max_query_len`` rows."""
        return kernel_takes(max_query_len, self.dtype, 0, self.shape.head_dim, self.block_size)

    def current(self, block_size: int) -> bool:
        """Whether this plan still describes its stack's tensors (and the cache's block size)."""
        return self.block_size == block_size and self.stamp.holds()

    def run(self, stack: DenseDecoderStack, x: torch.Tensor, ctx: ForwardContext, *, kernels: bool
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The output norm of the residual stream after the last layer for the step's rows ``x [T, hidden]``
        (their keys and values written to the caches), and the inputs of ``stack.captured_layers``. ``kernels``:
        the projections through the backend's kernels (else its ``linear``); attention through ``cpu_paged``'s
        kernel when it takes the step's rows (``kernel_attends``), else through the attention backend."""
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty_like(x)
        captured = {i: torch.empty_like(x) for i in stack.captured_layers}
        captures = None
        if captured:
            captures = (ctypes.c_void_p * (len(stack.layers) + 1))(
                *(captured[i].data_ptr() if i in captured else None for i in range(len(stack.layers) + 1)))
        index = [as_int64(t) for t in (ctx.positions, ctx.slot_mapping, ctx.seq_lens, ctx.query_start_loc,
                                        ctx.block_tables)]  # kept alive until the call returns
        tables = index[-1]
        projection = attention = workspace = None
        if not kernels:
            attends = not self.kernel_attends(ctx.max_query_len)
            size = _library().decode_step_workspace(ctypes.byref(self.shape), rows, int(attends))
            if self._workspace.numel() < size:
                self._workspace = torch.empty(size, dtype=torch.uint8)
            projection, workspace = ctypes.addressof(self._projection), self._workspace.data_ptr()
            if attends:
                q_size, kv_size = stack.heads * stack.head_dim, stack.kv_heads * stack.head_dim
                for name, width in (("q", q_size), ("k", kv_size), ("v", kv_size)):
                    setattr(self._attention, name, self._buffer(name, rows * width))
                attention = ctypes.addressof(self._attention)
        step = _Step(rows, tables.shape[0], tables.shape[1], *(t.data_ptr() for t in index), projection, attention,
                     workspace)
        self._stack, self._ctx = stack, ctx
        try:
            failed = _library().decode_step(ctypes.byref(self.shape), self.layers, ctypes.byref(step), x.data_ptr(),
                                            out.data_ptr(), self.final_norm.data_ptr(), self.cos.data_ptr(),
                                            self.sin.data_ptr(), captures, torch.get_num_threads())
        finally:
            self._stack = self._ctx = None
            self._results.clear()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if failed:
            raise MemoryError("plugins.cpu decode step: the kernel could not allocate its buffers")
        return out, captured

    def _buffer(self, name: str, size: int) -> int:
        """The address of a kept buffer of at least ``size`` elements of the model dtype (grown when a step needs
        more)."""
        held = self._buffers.get(name)
        if held is None or held.numel() < size:
            held = self._buffers[name] = torch.empty(size, dtype=self.dtype)
        return held.data_ptr()

    def _hand_over(self, caller: _Caller, result: torch.Tensor) -> int:
        """Point the kernel at ``result`` (kept alive while the kernel may read it); 0 for the callback."""
        result = result.contiguous()
        self._results.append(result)
        caller.out = result.data_ptr()
        return 0

    def _rows_at(self, address: int, rows: int, width: int) -> torch.Tensor:
        """The kernel's input rows ``[rows, width]`` at ``address``: in the workspace, or an attention output this
        plan handed over (views, not copies)."""
        offset = address - self._workspace.data_ptr()
        if 0 <= offset < self._workspace.numel():
            size = rows * width * (torch.finfo(self.dtype).bits // 8)
            return self._workspace[offset:offset + size].view(self.dtype).view(rows, width)
        held = next(t for t in self._results if t.data_ptr() == address)
        return held.view(rows, width)

    def _project(self, weight_id: int, rows: int, input_address: int) -> int:
        """``struct caller``'s call for a projection: the backend's ``linear`` on the kernel's input rows."""
        try:
            weight, bias = self.gemms[weight_id]
            x = self._rows_at(input_address, rows, weight.shape[1])
            return self._hand_over(self._projection, self.linear(x, weight, bias))
        except BaseException as error:  # raised again in run(): an exception cannot cross the C frames
            self._error = error
            return 1

    def _attend(self, layer: int, rows: int, _: int | None) -> int:
        """``struct caller``'s call for attention: the step's attention backend on the kernel's q, k, v."""
        try:
            stack, ctx = self._stack, self._ctx
            assert stack is not None and ctx is not None
            d = stack.head_dim
            q, k, v = (self._buffers[name][: rows * heads * d].view(rows, heads, d)
                       for name, heads in (("q", stack.heads), ("k", stack.kv_heads), ("v", stack.kv_heads)))
            out = ctx.backends["paged_attention"].paged_attention(q, k, v, stack.layers[layer].kv_cache, ctx,
                                                                  scale=stack.scale)
            return self._hand_over(self._attention, out.to(q.dtype))
        except BaseException as error:
            self._error = error
            return 1


class Stamp:
    """The addresses of a plan's weights and other tensors (caches) and the weights' version counters when it
    was taken; ``holds()`` says whether they are unchanged (a step checks it: ~30 µs for SmolLM2's 270 tensors,
    where ``map`` over the unbound getters beats a generator by 3×)."""

    _address = torch.Tensor.data_ptr
    _version = operator.attrgetter("_version")

    def __init__(self, weights: Sequence[torch.Tensor], others: Sequence[torch.Tensor] = ()) -> None:
        self.weights = list(weights)
        self.tensors = self.weights + list(others)
        self.values = self._read()

    @classmethod
    def of(cls, stack: DenseDecoderStack) -> Stamp:
        """The stamp of a decoder stack's weights and caches."""
        return cls([t for layer in stack.layers for t in (
            layer.input_norm, layer.qkv, layer.qkv_bias, layer.o_proj, layer.post_norm, layer.gate_up, layer.down,
            layer.q_norm, layer.k_norm) if t is not None] + [stack.final_norm],
            [c for layer in stack.layers for c in layer.kv_cache])

    def _read(self) -> tuple[list[int], list[int]]:
        return list(map(Stamp._address, self.tensors)), list(map(Stamp._version, self.weights))

    def holds(self) -> bool:
        return self._read() == self.values


class FusedDecoder:
    """``GemmBackend.decode_stack`` for a CPU GEMM backend whose kernels ``projection`` describes and whose op
    ``linear`` is: serves every step of a run whose attention is ``cpu_paged`` and whose weights all have a
    projection (None otherwise) — the projections of steps of at most ``max_rows(dtype)`` rows through the kernels
    (module docstring; the model's dtype), of longer steps through ``linear``. ``steps`` counts the steps it
    served through the kernels, ``long_steps`` those through ``linear``."""

    def __init__(self, projection: ProjectionOf, max_rows: Callable[[torch.dtype], int], linear: Linear) -> None:
        self.projection = projection
        self.max_rows = max_rows
        self.linear = linear
        self.steps = self.long_steps = 0
        # per stack its plan, or the stamp of the tensors with which it did not fit
        self._plans: weakref.WeakKeyDictionary[DenseDecoderStack, DecodeStep | Stamp] = weakref.WeakKeyDictionary()

    def __call__(self, stack: DenseDecoderStack, x: torch.Tensor, ctx: ForwardContext
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
        rows = x.shape[0]
        if (rows == 0 or ctx.max_query_len == 0
                or getattr(ctx.backends["paged_attention"], "name", None) != "cpu_paged"):
            return None
        plan = self._plans.get(stack)
        if isinstance(plan, Stamp) and plan.holds():
            return None
        if not isinstance(plan, DecodeStep) or not plan.current(ctx.block_size):
            plan = DecodeStep.build(stack, ctx.block_size, self.projection, self.linear)
            self._plans[stack] = Stamp.of(stack) if plan is None else plan
            if plan is None:
                return None
        kernels = rows <= self.max_rows(x.dtype) and plan.kernel_attends(ctx.max_query_len)
        if kernels:
            self.steps += 1
        else:
            self.long_steps += 1
        return plan.run(stack, x, ctx, kernels=kernels)
