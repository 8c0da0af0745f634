"""MoE layer time for a DeepSeek-V2-Lite-shaped layer, per MoE backend (issue 12).

The layer (``--shape v2lite``): hidden 2048, 64 routed experts of width 1408, top-6, plus 2 shared experts
(one dense SwiGLU of width 2816) and the float32 router GEMM; ``--shape v41``: DeepSeek-V4.1-Flash's
(``scripts/deepseek_v41_shaped.json``): hidden 4096, 64 routed experts of width 2048, top-6, 1 shared.
Tokens pick 6 distinct experts uniformly at random
(the balanced routing of ``kernels.force_balanced_routing``); the routing weights are random. Each
backend runs the same inputs; times are medians over ``--repeats`` rounds after ``--warmup`` calls,
each round calling every backend once (interleaved, so a busy machine slows them alike).

Reported per (backend, tokens): median ms; achieved bandwidth (bytes of the weights the step must read
— the active experts, the shared expert and the router — plus activations in and out, over the time)
and TFLOP/s (2 · multiply-adds of the router, the routed and the shared GEMMs, over the time). On the
GPU both are printed next to the H200 limits measured in ``reference/kernels.md``.

    python scripts/bench_moe.py --tokens 1 16 256 4096 --output moe.json            # every available backend
    python scripts/bench_moe.py --backends torch grouped --tokens 1 16 256 --repeats 5
    python scripts/bench_moe.py --shape v41 --backends triton triton_fp8 triton_fp4 --tokens 1 16 256 4096  # issue 33

``triton_fp4`` and ``torch_fp4`` run the same experts stored as DeepSeek-V4.1's FP4 (e2m1 codes with a ue8m0
scale per 32 inputs, ``quantize_e2m1`` of the bf16 weights) through ``TritonMoEBackend.experts_fp4`` and the
core's plain-torch reference (``deepseek_v4/fp4_moe.py``, one expert dequantized at a time).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    """One MoE layer's sizes: routed experts, top-k, hidden width, expert width, shared experts."""

    experts: int
    top_k: int
    hidden: int
    inter: int
    shared: int


def _v41_shape() -> Shape:
    """The MoE layer of ``scripts/deepseek_v41_shaped.json``."""
    text = json.loads((Path(__file__).parent / "deepseek_v41_shaped.json").read_text())["text_config"]
    return Shape(text["n_routed_experts"], text["num_experts_per_tok"], text["hidden_size"],
                 text["moe_intermediate_size"], text["n_shared_experts"])


SHAPES = {"v2lite": Shape(64, 6, 2048, 1408, 2), "v41": _v41_shape()}
# Limits measured on the H200 (reference/kernels.md §2): DeepGEMM FP8 dense peak and bf16 GEMM; the
# HBM figure is the H200's nominal 4.8 TB/s (not measured here).
H200_LIMITS = {"fp8_tflops": 1239.0, "bf16_tflops": 757.0, "hbm_gbs": 4800.0}


def backends_by_name() -> dict[str, Any]:
    """The core's reference and every backend of the moe plugin, by name (available or not)."""
    from deepinfer_moe.deepgemm_backend import DeepGemmMoEBackend
    from deepinfer_moe.grouped import GroupedMoEBackend
    from deepinfer_moe.triton_backend import TritonMoEBackend

    from deepinfer.model.layers.reference_deepseek import TorchMoEBackend

    backends = (TorchMoEBackend(), GroupedMoEBackend(), TritonMoEBackend(), TritonMoEBackend(fp8=True),
                DeepGemmMoEBackend(warmup_tokens=()), Fp4Experts("triton_fp4", TritonMoEBackend()),
                Fp4Experts("torch_fp4", TorchMoEBackend()))
    return {b.name: b for b in backends}


class Fp4Experts:
    """The experts stored as FP4 (``interfaces.Fp4ExpertWeights``) and run by ``inner``'s ``experts_fp4``
    (``triton_fp4``), or by the core's reference FP4 path when ``inner`` has none (``torch_fp4``)."""

    def __init__(self, name: str, inner: Any) -> None:
        self.name, self.inner = name, inner
        self.capabilities = inner.capabilities

    def available(self) -> bool:
        return self.inner.available()

    def prepare_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> Any:
        from deepinfer.interfaces import Fp4ExpertWeights
        from deepinfer.model.layers.fp4 import quantize_e2m1

        def stored(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # expert by expert: bounded temporaries
            packed, scales = zip(*(quantize_e2m1(expert) for expert in w), strict=True)
            return torch.stack(packed), torch.stack(scales)

        (q13, s13), (q2, s2) = stored(w13), stored(w2)
        return Fp4ExpertWeights(q13, s13, q2, s2, 32)

    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: Any) -> Any:
        from deepinfer.model.deepseek_v4.fp4_moe import ExpertTiles, fp4_experts

        if hasattr(self.inner, "experts_fp4"):
            return self.inner.experts_fp4(x, topk_ids, topk_weights, weights)
        tiles = (ExpertTiles(weights.w13, weights.w13_scale, x.dtype, "w13"),
                 ExpertTiles(weights.w2, weights.w2_scale, x.dtype, "w2"))
        return fp4_experts(x, topk_ids, topk_weights, *tiles, None)


def weight_bytes(backend: str, dtype: torch.dtype) -> float:
    """Bytes per routed-expert weight element as the backend stores it (FP8 adds one fp32 per 128², FP4 one
    byte per 32)."""
    if backend in ("triton_fp8", "deep_gemm"):
        return 1.0 + 4.0 / (128 * 128)
    if backend in ("triton_fp4", "torch_fp4"):
        return 0.5 + 1.0 / 32
    return torch.finfo(dtype).bits / 8


def layer_cost(shape: Shape, tokens: int, active_experts: int, backend: str,
               dtype: torch.dtype) -> tuple[float, float]:
    """``(bytes, flops)`` of one layer call: weights read once each (active experts, shared, router),
    activations in and out; flops are 2 per multiply-add."""
    act = torch.finfo(dtype).bits / 8
    expert = 3 * shape.inter * shape.hidden
    routed = active_experts * expert * weight_bytes(backend, dtype)
    shared = shape.shared * expert * act
    router = shape.experts * shape.hidden * 4
    activations = 2 * tokens * shape.hidden * act
    flops = 2 * tokens * ((shape.top_k + shape.shared) * expert + shape.experts * shape.hidden)
    return routed + shared + router + activations, flops


def make_layer(shape: Shape, device: str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    e, h, i, shared = shape.experts, shape.hidden, shape.inter, shape.shared * shape.inter
    return {"w13": rand(e, 2 * i, h, scale=h ** -0.5), "w2": rand(e, h, i, scale=i ** -0.5),
            "shared13": rand(2 * shared, h, scale=h ** -0.5), "shared2": rand(h, shared, scale=shared ** -0.5),
            "gate": (torch.randn(e, h, generator=gen) * h ** -0.5).to(device)}


def layer_fn(backend: Any, layer: dict[str, torch.Tensor], experts: Any, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """One MoE layer forward: router GEMM (float32; its top-k is replaced by the fixed balanced routing
    so every backend sees the same experts), routed experts through ``backend``, shared experts."""
    width = layer["shared2"].shape[1]

    def run(x: torch.Tensor) -> torch.Tensor:
        F.linear(x.float(), layer["gate"]).softmax(dim=-1)
        out = backend.experts(x, topk_ids, topk_weights, experts)
        gate, up = F.linear(x, layer["shared13"]).split(width, dim=-1)
        return out + F.linear(F.silu(gate) * up, layer["shared2"])

    return run


def time_calls(fn: Callable[[], Any], device: str, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="v2lite")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    ap.add_argument("--backends", nargs="+", default=None,
                    help="torch grouped triton triton_fp8 deep_gemm triton_fp4 torch_fp4 (default: every available "
                    "one)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    offered = backends_by_name()
    names = args.backends or [n for n, b in offered.items()
                              if b.available() and args.device in b.capabilities.devices
                              and dtype in b.capabilities.dtypes]
    unknown = [n for n in names if n not in offered]
    if unknown:
        ap.error(f"unknown backends {unknown}; known: {sorted(offered)}")
    shape = SHAPES[args.shape]
    layer = make_layer(shape, args.device, dtype, args.seed)
    # Each backend prepares its own copy: grouped re-lays its weights out in place, and the reference
    # must be timed on the layout the engine gives it.
    prepared = {name: offered[name].prepare_experts(layer["w13"].clone(), layer["w2"].clone())
                if hasattr(offered[name], "prepare_experts") else (layer["w13"], layer["w2"]) for name in names}
    results: list[dict[str, Any]] = []
    for tokens in args.tokens:
        gen = torch.Generator().manual_seed(args.seed + tokens)
        ids = torch.rand(tokens, shape.experts, generator=gen).topk(shape.top_k, dim=-1).indices.to(args.device)
        weights = (torch.rand(tokens, shape.top_k, generator=gen) + 0.1).to(args.device)
        x = torch.randn(tokens, shape.hidden, generator=gen).to(args.device, dtype)
        active = int(torch.unique(ids).numel())
        runs = {name: layer_fn(offered[name], layer, prepared[name], ids, weights) for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        for name in names:
            time_calls(lambda run=runs[name], x=x: run(x), args.device, args.warmup, 0)
        # Interleaved: one call of each backend per round, so a busy machine slows them alike.
        for _ in range(args.repeats):
            for name in names:
                times[name] += time_calls(lambda run=runs[name], x=x: run(x), args.device, 0, 1)
        for name in names:
            median = statistics.median(times[name])
            nbytes, flops = layer_cost(shape, tokens, active, name, dtype)
            row = {"backend": name, "tokens": tokens, "median_ms": median * 1e3,
                   "times_ms": [t * 1e3 for t in times[name]], "active_experts": active,
                   "bytes": nbytes, "flops": flops, "gbs": nbytes / median / 1e9, "tflops": flops / median / 1e12}
            results.append(row)
            print(f"{name:>11} T={tokens:>5}  {row['median_ms']:9.3f} ms  {row['gbs']:8.1f} GB/s  "
                  f"{row['tflops']:7.3f} TFLOP/s  ({active} experts active)", flush=True)
    meta = {"date": date.today().isoformat(), "device": args.device, "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "limits": H200_LIMITS if args.device == "cuda" else None,
            "shape": {"name": args.shape, **asdict(shape)},
            "repeats": args.repeats, "warmup": args.warmup, "command": " ".join(sys.argv)}
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
