"""A block drafter's context write and block pass in one C call each (``csrc/draft_step.c``):
``GemmBackend.draft_context`` and ``draft_block`` over an ``interfaces.BlockDrafterStack``.

The ``dspark`` drafter's step through its torch modules makes ~260 small ops around its dozen projections: on the
2-core Xeon 4.4 ms a batch-1 step, of which the projections take ~2 ms (docs/benchmarks.md, issue 28), a third of
a bf16 SmolLM2 decode step. Here each projection runs the GEMM backend's kernel for those rows (``projection``:
the ``onednn`` backend's GEMV), and the norms, rope, the window attention, SiLU·up, residual adds, the Markov
correction, argmax and confidences run in C between them. Greedy drafts only (a sampling request's drafts and
their distributions stay with the torch modules).

Which calls: a context write of at most ``max_rows`` rows and a block pass of at most ``max_rows`` rows (requests
× k), the weights in one dtype (float32 or bfloat16) that ``projection`` takes. The plan (the kernels' pointers,
float32 copies of the norm weights and the confidence head) is built once per stack and checked on every call
against the weights' addresses and version counters (``Stamp``).
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Callable

import torch

from deepinfer.interfaces import BlockDrafterStack
from deepinfer_cpu.cbuild import CSRC, build_library
from deepinfer_cpu.decode_step import Projection, ProjectionOf, Stamp
from deepinfer_cpu.paged_attention import as_int64

SOURCES = (CSRC / "draft_step.c", CSRC / "gemv.c", CSRC / "quant_linear.c")


class _DraftLayer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p)] + [
        (name, Projection) for name in ("qkv", "ctx_kv", "o", "gate_up", "down")]


class _DraftNet(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("layers", "hidden", "heads", "intermediate", "features",
                                                    "draft_vocab", "rank")] + [
        ("eps", ctypes.c_float), ("confidence_bias", ctypes.c_float), ("bf16", ctypes.c_int32),
        ("layer", ctypes.c_void_p)] + [(name, Projection) for name in ("main_proj", "head", "markov_head")] + [
        (name, ctypes.c_void_p) for name in ("main_norm", "norm", "inv_freq", "markov_embed", "confidence_weight",
                                             "confidence_temperature", "d2t", "t2d")]


@functools.cache
def _kernels() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    library = build_library(SOURCES)
    context, block = library.draft_context, library.draft_block
    context.restype = block.restype = ctypes.c_int
    context.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int]
    block.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 8 + [
        ctypes.c_int]
    return context, block


def _weights(stack: BlockDrafterStack) -> list[torch.Tensor]:
    return [stack.main_proj, stack.main_norm, stack.norm, stack.head, stack.markov_embed, stack.markov_head,
            stack.confidence_weight, stack.confidence_bias, stack.confidence_temperature, stack.inv_freq] + [
        t for layer in stack.layers for t in (layer.attn_norm, layer.qkv, layer.ctx_kv, layer.o, layer.mlp_norm,
                                              layer.gate_up, layer.down)] + [
        t for t in (stack.d2t, stack.t2d) if t is not None]


class DraftPlan:
    """One stack laid out for the kernel (module docstring); ``build`` gives None when a weight does not fit it."""

    def __init__(self, stack: BlockDrafterStack, net: _DraftNet, layers: ctypes.Array, kept: list[torch.Tensor]
                 ) -> None:
        self.dtype = stack.main_proj.dtype
        self.max_k = stack.confidence_temperature.shape[0]
        self.net, self.layers, self.kept = net, layers, kept
        self.stamp = Stamp(_weights(stack))

    @classmethod
    def build(cls, stack: BlockDrafterStack, projection: ProjectionOf) -> DraftPlan | None:
        dtype = stack.main_proj.dtype
        matrices = [stack.main_proj, stack.head, stack.markov_head] + [
            w for layer in stack.layers for w in (layer.qkv, layer.ctx_kv, layer.o, layer.gate_up, layer.down)]
        if (dtype not in (torch.float32, torch.bfloat16) or stack.markov_embed.dtype != dtype
                or any(t.dtype != dtype or t.device.type != "cpu" for t in matrices)):
            return None
        projections = [projection(w) for w in matrices]
        if any(p is None for p in projections):
            return None
        kept = [t for p in projections for t in p[1]]

        def floats(t: torch.Tensor) -> int:  # a float32 copy kept alive, its address
            kept.append(t.detach().float().contiguous().flatten())
            return kept[-1].data_ptr()

        def ids(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            kept.append(as_int64(t))
            return kept[-1].data_ptr()

        embed = stack.markov_embed.contiguous()
        kept.append(embed)
        (main_proj, _), (head, _), (markov_head, _) = projections[:3]
        layers = [_DraftLayer(floats(layer.attn_norm), floats(layer.mlp_norm), *(p for p, _ in projections[i:i + 5]))
                  for layer, i in zip(stack.layers, range(3, len(projections), 5), strict=True)]
        array = (_DraftLayer * len(layers))(*layers)
        hidden = stack.main_proj.shape[0]
        net = _DraftNet(len(layers), hidden, stack.heads, stack.layers[0].down.shape[1], stack.main_proj.shape[1],
                        stack.head.shape[0], stack.markov_head.shape[1], stack.eps,
                        float(stack.confidence_bias.float().item()), int(dtype == torch.bfloat16),
                        ctypes.addressof(array), main_proj, head, markov_head, floats(stack.main_norm),
                        floats(stack.norm), floats(stack.inv_freq), embed.data_ptr(),
                        floats(stack.confidence_weight), floats(stack.confidence_temperature), ids(stack.d2t),
                        ids(stack.t2d))
        return cls(stack, net, array, kept)


class FusedDrafter:
    """``GemmBackend.draft_context`` and ``draft_block`` for a CPU GEMM backend whose kernels ``projection``
    describes: serves the calls of at most ``max_rows(dtype)`` rows (module docstring; the drafter's dtype);
    False / None otherwise. ``calls`` counts the calls it served."""

    def __init__(self, projection: ProjectionOf, max_rows: Callable[[torch.dtype], int]) -> None:
        self.projection = projection
        self.max_rows = max_rows
        self.calls = 0
        # per stack its plan, or the stamp of the weights with which it did not fit
        self._plans: weakref.WeakKeyDictionary[BlockDrafterStack, DraftPlan | Stamp] = weakref.WeakKeyDictionary()

    def _plan(self, stack: BlockDrafterStack, rows: int) -> DraftPlan | None:
        if not 0 < rows <= self.max_rows(stack.main_proj.dtype):
            return None
        plan = self._plans.get(stack)
        if isinstance(plan, Stamp) and plan.holds():
            return None
        if not isinstance(plan, DraftPlan) or not plan.stamp.holds():
            plan = DraftPlan.build(stack, self.projection)
            self._plans[stack] = Stamp(_weights(stack)) if plan is None else plan
        return plan

    def draft_context(self, stack: BlockDrafterStack, features: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, cache: torch.Tensor) -> bool:
        """The context rows of ``features [N, hidden·L]`` into ``cache`` (``GemmBackend.draft_context``)."""
        plan = self._plan(stack, features.shape[0])
        if plan is None or features.dtype != plan.dtype or cache.dtype != plan.dtype or not cache.is_contiguous():
            return False
        features, positions, slots = features.contiguous(), as_int64(positions), as_int64(slots)
        failed = _kernels()[0](ctypes.byref(plan.net), features.shape[0], features.data_ptr(), positions.data_ptr(),
                               slots.data_ptr(), cache.data_ptr(), torch.get_num_threads())
        if failed:
            raise MemoryError("plugins.cpu draft step: the kernel could not allocate its buffers")
        self.calls += 1
        return True

    def draft_block(self, stack: BlockDrafterStack, cache: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                    embedded: torch.Tensor, last_tokens: torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Greedy drafts and their confidences ``[B, k]`` (``GemmBackend.draft_block``)."""
        batch, k, _ = embedded.shape
        plan = self._plan(stack, batch * k)
        if (plan is None or k > plan.max_k or embedded.dtype != plan.dtype or cache.dtype != plan.dtype
                or not cache.is_contiguous()):
            return None
        embedded, slots, last_tokens, positions = (
            embedded.contiguous(), as_int64(slots), as_int64(last_tokens), as_int64(positions))
        visible = visible.to(torch.uint8).contiguous()
        tokens = torch.empty(batch, k, dtype=torch.int64)
        confidence = torch.empty(batch, k, dtype=torch.float32)
        failed = _kernels()[1](ctypes.byref(plan.net), batch, k, slots.shape[1], cache.data_ptr(), slots.data_ptr(),
                               visible.data_ptr(), embedded.data_ptr(), last_tokens.data_ptr(), positions.data_ptr(),
                               tokens.data_ptr(), confidence.data_ptr(), torch.get_num_threads())
        if failed:
            raise MemoryError("plugins.cpu draft step: the kernel could not allocate its buffers")
        self.calls += 1
        return tokens, confidence
