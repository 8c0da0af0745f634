"""``deep_gemm``: routed experts through DeepGEMM 2.x's FP8 grouped GEMMs (registry name
``deepinfer-gemm``, import ``deep_gemm``; ``reference/kernels.md`` §2).

Two layouts, both built on the device without a host sync (``layout.py``):

- **masked** (decode, up to ``masked_max_tokens`` tokens): each expert gets ``m_max`` rows (``T``
  rounded up to 64), pair rows are scattered into ``[E, m_max, H]`` and
  ``m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m)`` computes only each expert's first
  ``masked_m[e]`` rows; ``expected_m`` (a host int hint) is ``⌈T·k/E⌉``, known from the shapes.
- **contiguous** (prefill): pairs sorted by expert, each expert's run starting at a multiple of
  ``get_mk_alignment_for_contiguous_layout()`` (128 on the H200), and
  ``m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout)`` with ``grouped_layout[row]`` the
  row's expert, −1 on padding rows.

Between the GEMMs SwiGLU runs on the pair rows only and its output is quantized per token and 128
channels (plain torch). Calls follow DeepGEMM 2.x's documented names: NT layout (A ``[M, K]``,
B ``[G, N, K]``, both K-major), ``(tensor, scale)`` pairs, preallocated bf16 ``d``. On SM90 the scales
are float32 (activation ``[M, K/128]``, weight ``[G, N/128, K/128]``); on SM100 DeepGEMM wants UE8M0,
so weights and activations are quantized with power-of-two scales there and the library's own cast
is lossless (SM100 is untested: the lent GPU is an H200).

Every (N, K, block config) is JIT-compiled by NVCC on first use (4–7 s each, ``kernels.md`` §2), so
``prepare_experts`` runs the layer once per size in ``warmup_tokens`` at load: the cubins land in
``DG_JIT_CACHE_DIR`` (default ``~/.dj``) and later processes start warm.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer.interfaces import BackendCapabilities
from deepinfer_moe.fp8 import Fp8Experts, quantize_rows
from deepinfer_moe.layout import contiguous_rows, masked_slots

logger = logging.getLogger(__name__)


@functools.cache
def deep_gemm_module() -> Any | None:
    """``deep_gemm`` if it imports on an SM90/SM100 GPU, else None (the reason is logged once).
    Importing it initialises its C++ runtime, so it is never tried without a suitable GPU."""
    if not torch.cuda.is_available():
        return None
    major = torch.cuda.get_device_capability()[0]
    if major not in (9, 10):
        logger.info("deep_gemm backend: compute capability %d.x is not SM90/SM100", major)
        return None
    try:
        import deep_gemm
    except ImportError as exc:
        logger.info("deep_gemm backend: deep_gemm does not import (%s)", exc)
        return None
    return deep_gemm


class DeepGemmMoEBackend:
    """Op ``experts`` through DeepGEMM's FP8 grouped GEMMs (see the module docstring)."""

    name = "deep_gemm"
    ops = frozenset({"experts"})
    capabilities = BackendCapabilities(devices=frozenset({"cuda"}), dtypes=frozenset({torch.bfloat16}),
                                       graph_safe=True, batch_invariant=False, varlen=True)

    def __init__(self, *, masked_max_tokens: int = 64, warmup_tokens: tuple[int, ...] = (), priority: int = 4) -> None:
        self.masked_max_tokens = masked_max_tokens
        self.warmup_tokens = tuple(warmup_tokens)
        self.priority = priority
        self._warm: set[tuple[int, ...]] = set()

    def available(self) -> bool:
        return deep_gemm_module() is not None

    def _lib(self) -> Any:
        lib = deep_gemm_module()
        if lib is None:
            raise RuntimeError("deep_gemm backend: deep_gemm is not importable on this machine (SM90/SM100 "
                               "GPU and the deepinfer-gemm package needed)")
        return lib

    @staticmethod
    def _pow2() -> bool:
        return torch.cuda.get_device_capability()[0] == 10

    def prepare_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> Fp8Experts:
        """Quantize to 128×128 FP8 tiles (power-of-two scales on SM100), then warm the JIT cache by
        running the layer at every size of ``warmup_tokens`` (once per expert shape per process)."""
        experts = Fp8Experts.quantize(w13.detach(), w2.detach(), pow2=self._pow2())
        shape = (*w13.shape, *w2.shape)
        if self.warmup_tokens and shape not in self._warm:
            self._warm.add(shape)
            self.warm_up(experts, top_k=min(8, w13.shape[0]))
        return experts

    def warm_up(self, experts: Fp8Experts, top_k: int) -> None:
        """Run both GEMM layouts at every size of ``warmup_tokens`` on random routing, so NVCC compiles
        their kernels now rather than inside the first requests."""
        num_experts, hidden = experts.w13.shape[0], experts.w13.shape[2]
        device = experts.w13.device
        gen = torch.Generator(device=device).manual_seed(0)
        for tokens in self.warmup_tokens:
            x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
            scores = torch.rand(tokens, num_experts, device=device, generator=gen)
            ids = scores.topk(top_k, dim=-1).indices
            self.experts(x, ids, torch.ones(tokens, top_k, device=device), experts)
        torch.cuda.synchronize(device)  # deliberate: start-up only, so compile errors surface here
        logger.info("deep_gemm: warmed the JIT cache for %d experts, hidden %d, at %s tokens",
                    num_experts, hidden, list(self.warmup_tokens))

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                weights: Any, *, swiglu_limit: float | None = None) -> torch.Tensor:
        """``weights`` is the ``Fp8Experts`` from ``prepare_experts``; returns ``[T, H]`` bf16."""
        if not isinstance(weights, Fp8Experts):
            raise TypeError("deep_gemm: expert weights were not prepared; call prepare_experts(w13, w2) and "
                            f"pass its result (got {type(weights).__name__})")
        tokens = topk_ids.shape[0]
        if tokens == 0:  # an idle expert-parallel rank
            return x.new_zeros(0, x.shape[1])
        if tokens <= self.masked_max_tokens:
            per_pair = self._masked(x, topk_ids, weights, swiglu_limit)
        else:
            per_pair = self._contiguous(x, topk_ids, weights, swiglu_limit)
        weighted = per_pair.float() * topk_weights.reshape(-1, 1).float()
        return weighted.view(tokens, topk_ids.shape[1], x.shape[1]).sum(dim=1).to(x.dtype)

    def _swiglu_fp8(self, gate_up: torch.Tensor, inter: int, limit: float | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = gate_up[:, :inter].float(), gate_up[:, inter:].float()
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return quantize_rows(F.silu(gate) * up, pow2=self._pow2())

    def _masked(self, x: torch.Tensor, topk_ids: torch.Tensor, w: Fp8Experts, limit: float | None) -> torch.Tensor:
        """Pair outputs ``[P, H]`` through the masked layout."""
        lib = self._lib()
        tokens, top_k = topk_ids.shape
        num_experts, inter, hidden = w.w13.shape[0], w.intermediate, x.shape[1]
        slots = masked_slots(topk_ids, num_experts)
        rows = num_experts * slots.m_max
        token_of_pair = torch.arange(tokens * top_k, device=x.device) // top_k
        xq, xs = quantize_rows(x, pow2=self._pow2())
        # Rows past masked_m are never computed into a stored result: left uninitialised on purpose.
        a = torch.empty(rows, hidden, dtype=xq.dtype, device=x.device)
        a_scale = torch.empty(rows, xs.shape[1], dtype=torch.float32, device=x.device)
        # FP8 rows move as bytes: indexing kernels for float8 dtypes are not available everywhere.
        a.view(torch.uint8)[slots.slot] = xq.view(torch.uint8)[token_of_pair]
        a_scale[slots.slot] = xs[token_of_pair]
        expected_m = max(1, -(-tokens * top_k // num_experts))
        gate_up = torch.empty(num_experts, slots.m_max, 2 * inter, dtype=torch.bfloat16, device=x.device)
        lib.m_grouped_fp8_gemm_nt_masked(
            (a.view(num_experts, slots.m_max, hidden), a_scale.view(num_experts, slots.m_max, -1)),
            (w.w13, w.w13_scale), gate_up, slots.counts, expected_m)
        hq, hs = self._swiglu_fp8(gate_up.view(rows, -1)[slots.slot], inter, limit)
        h = torch.empty(rows, inter, dtype=hq.dtype, device=x.device)
        h_scale = torch.empty(rows, hs.shape[1], dtype=torch.float32, device=x.device)
        h.view(torch.uint8)[slots.slot] = hq.view(torch.uint8)
        h_scale[slots.slot] = hs
        out = torch.empty(num_experts, slots.m_max, hidden, dtype=torch.bfloat16, device=x.device)
        lib.m_grouped_fp8_gemm_nt_masked(
            (h.view(num_experts, slots.m_max, inter), h_scale.view(num_experts, slots.m_max, -1)),
            (w.w2, w.w2_scale), out, slots.counts, expected_m)
        return out.view(rows, hidden)[slots.slot]

    def _contiguous(self, x: torch.Tensor, topk_ids: torch.Tensor, w: Fp8Experts, limit: float | None
                    ) -> torch.Tensor:
        """Pair outputs ``[P, H]`` through the contiguous layout."""
        lib = self._lib()
        tokens, top_k = topk_ids.shape
        num_pairs = tokens * top_k
        num_experts, inter, hidden = w.w13.shape[0], w.intermediate, x.shape[1]
        layout, row_expert = contiguous_rows(topk_ids, num_experts, lib.get_mk_alignment_for_contiguous_layout())
        valid = layout.pairs < num_pairs
        # Padding rows read token 0: finite data in rows whose results are never read.
        token_of_row = torch.where(valid, layout.pairs // top_k, 0).long()
        xq, xs = quantize_rows(x, pow2=self._pow2())
        rows = layout.pairs.shape[0]
        gate_up = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device=x.device)
        a = xq.view(torch.uint8)[token_of_row].view(xq.dtype)  # FP8 rows move as bytes
        lib.m_grouped_fp8_gemm_nt_contiguous((a, xs[token_of_row]), (w.w13, w.w13_scale), gate_up, row_expert)
        hq, hs = self._swiglu_fp8(gate_up, inter, limit)
        out = torch.empty(rows, hidden, dtype=torch.bfloat16, device=x.device)
        lib.m_grouped_fp8_gemm_nt_contiguous((hq, hs), (w.w2, w.w2_scale), out, row_expert)
        # Row of each pair; padding rows all land in the spare slot ``num_pairs``, which is dropped.
        row_of_pair = torch.empty(num_pairs + 1, dtype=torch.int64, device=x.device)
        row_of_pair.scatter_(0, layout.pairs.long(), torch.arange(rows, device=x.device))
        return out[row_of_pair[:num_pairs]]
