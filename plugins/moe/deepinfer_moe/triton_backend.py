"""``triton`` and ``triton_fp8``: fused-expert MoE backends for the GPU, written in Triton.

Per step: build the token layout on the device (``layout.py``: the decode layout for a few tokens,
the expert-sorted block layout otherwise), run ``gate_up`` (grouped GEMM + SwiGLU) and ``down``
(grouped GEMM × routing weight) from ``triton_kernels.py``, and sum each token's ``k`` rows. No step
reads the device from the host, every shape is fixed by ``(T, k, E)``, so the MoE layer can be
captured in a CUDA graph.

``triton`` also serves ``experts_fp4``: DeepSeek-V4.1's FP4 experts read as stored, each weight tile
dequantized in registers.

``triton_fp8`` keeps the routed experts in 128×128 block-scaled FP8 (``fp8.Fp8Experts``), quantized
once in ``prepare_experts`` from the model's bf16 weights (which the core dequantized from an FP8
checkpoint's ``weight_scale_inv`` when the checkpoint is FP8; re-quantizing recovers the same FP8
values). Activations are quantized per token and 128 channels before each GEMM (plain torch ops).
FP8 changes the numbers, so ``kernels.moe: auto`` never picks it: name it.

``available()`` needs ``import triton`` and either CUDA or ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter, used by the tests; it is slow and only meant for checking the kernels' logic).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.interfaces import BackendCapabilities, Fp4ExpertWeights, RoutingSpec
from deepinfer.testing import triton_interpreting
from deepinfer_moe.fp8 import Fp8Experts, quantize_rows
from deepinfer_moe.layout import group_by_expert, pair_view, sorted_blocks

_GPU_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one launch pair: ``block_m`` rows per block (the layout's), ``block_n``/``block_k``
    the GEMM tile, and Triton's ``num_warps``/``num_stages``."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def choose_tiles(num_tokens: int, top_k: int, num_experts: int, fp8: bool, decode_max_tokens: int) -> Tiles:
    """Tiles from the shapes alone (host ints; no routing data). FP8 needs ``block_k == 128`` (one scale
    per K step). Rows per block follow the expected rows per expert, ``T·k/E``: a decode block holds one
    pair, so 16 (``tl.dot``'s minimum) wastes nothing that matters when the weights dominate."""
    block_k = 128 if fp8 else 64
    if num_tokens <= decode_max_tokens:
        return Tiles(16, 64, 128, num_warps=4, num_stages=3)
    rows_per_expert = num_tokens * top_k / num_experts
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64
    return Tiles(block_m, 64, block_k, num_warps=4, num_stages=3)


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def contiguous_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert parameters themselves, made contiguous in place if another backend re-laid them out."""
    with torch.no_grad():
        for param in (w13, w2):
            if not param.is_contiguous():
                param.data = param.data.contiguous()
    return w13, w2


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, *, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  decode_max_tokens: int = 4, swiglu_limit: float | None = None,
                  sort_free_layout: bool = True, fp4_block: int | None = None) -> torch.Tensor:
    """The MoE op on Triton: ``x [T, H]`` → ``Σ_j topk_weights[t, j] · expert_{ids[t, j]}(x[t])`` ``[T, H]``
    in ``x.dtype``. With ``w13_scale``/``w2_scale`` the weights are FP8 (``Fp8Experts`` layout), or with
    ``fp4_block`` FP4 (``Fp4ExpertWeights``: packed e2m1 bytes and ue8m0 scales, activations as they are).
    Layouts: ``pair_view`` up to ``decode_max_tokens`` tokens (no launch), ``small_sorted_blocks`` (one
    launch) while the step fits it and ``sort_free_layout`` is on, else the torch ``sorted_blocks``."""
    from deepinfer_moe import triton_kernels as kernels  # imports triton; only when this backend runs
    from deepinfer_moe.layout_kernel import fits_small_layout, small_sorted_blocks

    fp8 = w13_scale is not None and fp4_block is None
    tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    if tokens == 0:  # an idle expert-parallel rank: nothing to launch (a zero-size grid is an error)
        return x.new_zeros(0, x.shape[1])
    tiles = choose_tiles(tokens, top_k, num_experts, fp8, decode_max_tokens)
    if tokens <= decode_max_tokens:
        layout = pair_view(topk_ids, tiles.block_m)
    elif sort_free_layout and fits_small_layout(tokens * top_k, num_experts):
        layout = small_sorted_blocks(topk_ids, num_experts, tiles.block_m)
    else:
        layout = sorted_blocks(topk_ids, num_experts, tiles.block_m, group_by_expert(topk_ids, num_experts))
    launch = {"block_n": tiles.block_n, "block_k": tiles.block_k, "num_warps": tiles.num_warps,
              "num_stages": tiles.num_stages}
    limit = {"swiglu_limit": swiglu_limit}
    if fp8:
        xq, x_scale = quantize_rows(x)
        h = kernels.gate_up(xq, x_scale, w13, w13_scale, layout, top_k, out_dtype=x.dtype, **launch, **limit)
        hq, h_scale = quantize_rows(h)
        per_pair = kernels.down(hq, h_scale, w2, w2_scale, topk_weights, layout, out_dtype=x.dtype, **launch)
    else:
        fp4 = {"fp4_block": fp4_block}
        h = kernels.gate_up(x.contiguous(), None, w13, w13_scale, layout, top_k, out_dtype=x.dtype, **launch,
                            **limit, **fp4)
        per_pair = kernels.down(h, None, w2, w2_scale, topk_weights, layout, out_dtype=x.dtype, **launch, **fp4)
    return kernels.sum_pairs(per_pair, top_k, x.dtype)


class TritonMoEBackend:
    """Op ``experts`` through the Triton kernels; ``fp8=True`` is ``triton_fp8``. With ``fused_router``
    it also offers ``select_experts`` (``router_kernel.py``); ``sort_free_layout`` builds small steps'
    layout in one launch (``layout_kernel.py``)."""

    ops = frozenset({"experts"})

    def __init__(self, *, fp8: bool = False, decode_max_tokens: int = 4, fused_router: bool = True,
                 sort_free_layout: bool = True) -> None:
        self.fp8 = fp8
        self.decode_max_tokens = decode_max_tokens
        self.fused_router = fused_router
        self.sort_free_layout = sort_free_layout
        self.name = "triton_fp8" if fp8 else "triton"
        self.interpret = triton_interpreting()
        # bf16 Triton outranks ``grouped`` (10); FP8 is lossy and is only used when named. Under the
        # interpreter the kernels serve CPU runs too, but only when named: auto keeps ``grouped``.
        self.priority = 1 if self.interpret else 5 if fp8 else 20
        self.capabilities = BackendCapabilities(
            devices=frozenset({"cuda", "cpu"}) if self.interpret else frozenset({"cuda"}),
            dtypes=_GPU_DTYPES, graph_safe=True, batch_invariant=False, varlen=True)

    def available(self) -> bool:
        if not triton_importable():
            return False
        return torch.cuda.is_available() or triton_interpreting()

    def prepare_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> Any:
        """bf16: the parameters themselves, made contiguous in place if another backend re-laid them
        out; FP8: an ``Fp8Experts`` copy quantized with 128×128 tiles (the bf16 originals stay)."""
        if self.fp8:
            return Fp8Experts.quantize(w13.detach(), w2.detach())
        return contiguous_experts(w13, w2)

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                weights: Any, *, swiglu_limit: float | None = None) -> torch.Tensor:
        """``weights`` is what ``prepare_experts`` returned (bf16: raw ``(w13, w2)`` work too)."""
        if self.fp8:
            if not isinstance(weights, Fp8Experts):
                raise TypeError("triton_fp8: expert weights were not prepared; call prepare_experts(w13, w2) "
                                f"and pass its result (got {type(weights).__name__})")
            return fused_experts(x, topk_ids, topk_weights, weights.w13, weights.w2, w13_scale=weights.w13_scale,
                                 w2_scale=weights.w2_scale, decode_max_tokens=self.decode_max_tokens,
                                 swiglu_limit=swiglu_limit, sort_free_layout=self.sort_free_layout)
        w13, w2 = weights
        return fused_experts(x, topk_ids, topk_weights, w13.contiguous(), w2.contiguous(),
                             decode_max_tokens=self.decode_max_tokens, swiglu_limit=swiglu_limit,
                             sort_free_layout=self.sort_free_layout)

    def experts_fp4(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    weights: Fp4ExpertWeights, *, swiglu_limit: float | None = None) -> torch.Tensor | None:
        """FP4 experts read as stored, each weight tile dequantized in registers (``MoEBackend.experts_fp4``;
        ``triton_kernels.py``). The bf16 backend serves it (``triton_fp8`` declines: its activations are FP8),
        on CUDA or under the interpreter."""
        if self.fp8 or (x.device.type != "cuda" and not self.interpret):
            return None
        return fused_experts(x, topk_ids, topk_weights, weights.w13, weights.w2, w13_scale=weights.w13_scale,
                             w2_scale=weights.w2_scale, fp4_block=weights.block,
                             decode_max_tokens=self.decode_max_tokens, swiglu_limit=swiglu_limit,
                             sort_free_layout=self.sort_free_layout)

    @torch.compiler.disable
    def select_experts(self, logits: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                       spec: RoutingSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The router in one launch (``MoEBackend.select_experts``); None (the model's reference
        router) when ``fused_router`` is off, the spec does not fit (``router_fits``) or the logits are
        on a device the kernels do not serve."""
        from deepinfer_moe import router_kernel  # imports triton; only when this backend runs

        if not self.fused_router or not router_kernel.router_fits(spec, logits.shape[1]):
            return None
        if logits.device.type != "cuda" and not self.interpret:
            return None
        return router_kernel.select_experts(logits, bias, positions, spec)
