"""Per-layer GEMM time on CPU at SmolLM2's shapes: float32 and bf16 through ``plugins.cpu``'s ``onednn``
backend (as an engine run uses it: torch's matrix-vector product at 1 row, oneDNN's packed weight above)
against the weight-only ``cpu_int8`` / ``cpu_q4_1`` kernels (issue 36 item 2; docs/benchmarks.md).

Every (shape, rows) times each variant in turn, ``--rounds`` times interleaved, ``--calls`` calls per round; the
table gives the median over rounds of each round's best call (a shared machine's preemptions inflate single
calls) in microseconds.

    python scripts/bench_quant_gemm.py --rows 1 8 32 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from deepinfer_cpu.onednn import OneDNNGemmBackend
from deepinfer_cpu.quant_linear import QuantizedGemmBackend

# SmolLM2-135M: fused q/k/v, o, fused gate/up, down, the tied LM head (out, in).
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def best_of(fn: Callable[[], object], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| layer (out × in) | rows | fp32 µs | bf16 µs | int8 µs | q4_1 µs | fp32 / int8 | fp32 / q4_1 |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, (out, inp) in SHAPES.items():
        base = torch.randn(out, inp, generator=gen) * 0.05
        variants: dict[str, tuple[object, torch.nn.Parameter, torch.dtype]] = {}
        for label, backend, dtype in (("fp32", OneDNNGemmBackend(), torch.float32),
                                      ("bf16", OneDNNGemmBackend(), torch.bfloat16),
                                      ("int8", QuantizedGemmBackend("int8"), torch.float32),
                                      ("q4_1", QuantizedGemmBackend("q4_1", head_rows=SHAPES["lm_head"][0]),
                                       torch.float32)):
            weight = torch.nn.Parameter(base.to(dtype), requires_grad=False)
            weight.data = backend.prepare_weight(weight.data)
            variants[label] = (backend, weight, dtype)
        for rows in args.rows:
            x = torch.randn(rows, inp, generator=gen)
            samples: dict[str, list[float]] = {label: [] for label in variants}
            for _ in range(args.rounds):
                for label, (backend, weight, dtype) in variants.items():
                    xd = x.to(dtype)
                    samples[label].append(best_of(lambda b=backend, w=weight, xd=xd: b.linear(xd, w), args.calls))
            med = {label: statistics.median(v) for label, v in samples.items()}
            cells = " | ".join(f"{med[label]:.0f}" for label in ("fp32", "bf16", "int8", "q4_1"))
            print(f"| {name} ({out} × {inp}) | {rows} | {cells} | {med['fp32'] / med['int8']:.2f} | "
                  f"{med['fp32'] / med['q4_1']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
