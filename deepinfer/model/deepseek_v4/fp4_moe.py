"""DeepSeek-V4.1 routed experts stored as FP4 (``quantization_config.expert_dtype: fp4``).

The checkpoint's bytes are kept as stored (reference/deepinfer.md §8, ``hugging_face/weights.py``): per layer
``w13_fp4 uint8 [E, 2I, H/2]`` (each expert's ``[w1; w3]`` rows, e2m1 packed, the even index in the low
nibble) with ``w13_scale uint8 [E, 2I, H/32]`` (ue8m0, one per 32 inputs) and ``w2_fp4 [E, H, I/2]`` with
``w2_scale [E, H, I/32]`` — about a quarter of the bf16 bytes (half a byte per weight plus 1/32 of a byte). No
bf16 copy of the experts is ever made: the plain-torch reference path dequantizes one expert's tile at a
time when a step routes tokens to it (``ExpertTiles``), then runs the same sorted-expert math as the bf16
reference backend (``reference_deepseek.sorted_experts``), so on the dequantized weights it equals the
bf16 layer bit for bit (dequantization is exact, ``layers/fp4.py``).

This is the CPU oracle. A run's ``experts`` backend may read the stored bytes itself
(``MoEBackend.experts_fp4``, ``interfaces.Fp4ExpertWeights``: ``plugins/moe``'s Triton kernels dequantize
tiles in registers); when it has no such method or declines a call, the reference runs. Expert parallelism
and expert shards are refused.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.errors import ConfigError
from deepinfer.interfaces import ForwardContext, Fp4ExpertWeights
from deepinfer.model.deepseek_v4.config import V4Dims
from deepinfer.model.deepseek_v4.moe import V4MoE
from deepinfer.model.layers.fp4 import dequantize_e2m1
from deepinfer.model.layers.reference_deepseek import sorted_experts

FP4_BLOCK = 32  # values per ue8m0 scale along the input dimension (weight_block_size's inner 32)


class ExpertTiles:
    """A stack of FP4 expert matrices that dequantizes expert ``e`` when indexed: ``tiles[e]`` is
    ``[rows, cols]`` in ``dtype``; ``shape`` is the logical ``(E, rows, cols)``. What
    ``sorted_experts`` reads instead of a dense ``[E, rows, cols]`` tensor."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str) -> None:
        self.packed, self.scales, self.dtype, self.name = packed, scales, dtype, name
        self.shape = torch.Size((packed.shape[0], packed.shape[1], 2 * packed.shape[2]))

    def __getitem__(self, e: int) -> torch.Tensor:
        return dequantize_e2m1(self.packed[e], self.scales[e], FP4_BLOCK, dtype=self.dtype, name=f"{self.name}[{e}]")

    def dense(self) -> torch.Tensor:
        """Every expert dequantized, ``[E, rows, cols]`` (tests and measurements; the model never calls it)."""
        return dequantize_e2m1(self.packed, self.scales, FP4_BLOCK, dtype=self.dtype, name=self.name)


def fp4_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: ExpertTiles,
                w2: ExpertTiles, swiglu_limit: float | None) -> torch.Tensor:
    """The reference FP4 expert compute: ``x [T, H]``, ``topk_ids``/``topk_weights [T, k]`` → ``[T, H]``,
    each active expert's ``w13``/``w2`` dequantized to ``x.dtype`` just before its two matmuls (reads the
    per-expert counts on the host once, as the bf16 reference does)."""
    return sorted_experts(x, topk_ids, topk_weights, (w13, w2), swiglu_limit, F.linear)  # type: ignore[arg-type]


class V4Fp4MoE(V4MoE):
    """``V4MoE`` whose routed experts are stored FP4 (module docstring); gate, bias and shared experts as
    ``V4MoE`` (bf16/fp32)."""

    def __init__(self, d: V4Dims, layer: int, mlp_type: str, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        for field, size in (("hidden_size", d.hidden), ("moe_intermediate_size", d.moe_inter)):
            if size % FP4_BLOCK:
                raise ConfigError(f"config.json {field} = {size}: expert_dtype fp4 needs a multiple of "
                                  f"{FP4_BLOCK} (one ue8m0 scale per {FP4_BLOCK} weights)")
        self.compute_dtype = dtype
        super().__init__(d, layer, mlp_type, dtype, device)
        if len(self.expert_ids) != d.n_routed:
            raise ConfigError(f"layer {layer}: expert_dtype fp4 experts are not sharded over expert-parallel ranks "
                              "yet (parallel.expert_parallel)")

    def _init_experts(self, kw: dict[str, Any]) -> None:
        e, inter, hidden = len(self.expert_ids), self.d.moe_inter, self.d.hidden
        u8 = {"dtype": torch.uint8, "device": kw["device"]}

        def stored(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, **u8), requires_grad=False)

        self.w13_fp4 = stored(e, 2 * inter, hidden // 2)
        self.w13_scale = stored(e, 2 * inter, hidden // FP4_BLOCK)
        self.w2_fp4 = stored(e, hidden, inter // 2)
        self.w2_scale = stored(e, hidden, inter // FP4_BLOCK)

    @torch.no_grad()
    def fill_dummy(self, seed: int, std: float) -> None:
        """Dummy weights (``load_format=dummy``, ``loader.init_dummy``): uniform random e2m1 codes (standard
        deviation about 2.9) under the one ue8m0 scale that brings it nearest ``std``, seeded by (``seed``,
        layer)."""
        gen = torch.Generator(device=self.w13_fp4.device).manual_seed(zlib.crc32(f"{seed}:fp4:{self.layer}".encode()))
        byte = 127 + round(math.log2(std / 2.9))
        for packed, scales in ((self.w13_fp4, self.w13_scale), (self.w2_fp4, self.w2_scale)):
            packed.random_(0, 256, generator=gen)
            scales.fill_(byte)

    def expert_tiles(self, dtype: torch.dtype | None = None) -> tuple[ExpertTiles, ExpertTiles]:
        """``(w13, w2)`` as lazily dequantized tiles in ``dtype`` (default: the model's dtype)."""
        dtype = dtype or self.compute_dtype
        return (ExpertTiles(self.w13_fp4, self.w13_scale, dtype, f"layers.{self.layer}.mlp.w13"),
                ExpertTiles(self.w2_fp4, self.w2_scale, dtype, f"layers.{self.layer}.mlp.w2"))

    def stored(self) -> Fp4ExpertWeights:
        """The experts' bytes as a backend reads them (``MoEBackend.experts_fp4``)."""
        return Fp4ExpertWeights(self.w13_fp4, self.w13_scale, self.w2_fp4, self.w2_scale, FP4_BLOCK)

    def routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ctx: ForwardContext,
               limit: float | None) -> torch.Tensor:
        kernel = getattr(ctx.backends.get("experts"), "experts_fp4", None)
        out = kernel(x, ids, weights, self.stored(), swiglu_limit=limit) if kernel is not None else None
        if out is not None:
            return out
        w13, w2 = self.expert_tiles(x.dtype)
        return fp4_experts(x, ids, weights, w13, w2, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        if self.expert_parallel is not None:
            raise ConfigError("expert_dtype fp4: expert parallelism does not run FP4 experts yet")
        return super().forward(x, input_ids, positions, ctx)
