"""Decode-sized linears on the GPU: ``triton_gemv`` (plugins/attention ``gemv.py``) against cuBLAS
(``F.linear``), at the Llama-3-8B-shaped model's projections (issue 29's GEMV item).

    python scripts/bench_gemv.py [--rows 1 4 16] [--output docs/bench/h200_gemv.json]

Per (rows M, projection [N, K]) both run inside one CUDA graph of ``CALLS`` calls, each on another copy
of the weight (more than 400 MB of copies in all, so the 50 MB L2 never holds the next weight); the
graph's replay time over the calls gives µs per call (median of ``--repeats`` replays) and the weight's
read bandwidth, TB/s = N·K·2 bytes / time. bf16 in, bf16 out. The GEMV runs with each of ``CONFIGS``
(tile sizes, program target); its default is the first.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CALLS = 32
# (block_n, block_k, target programs) of gemv tried; the first is gemv's default.
CONFIGS = [(64, 128, 264), (32, 128, 264), (64, 256, 264), (64, 128, 528)]


def time_graph(fn, xs: list[torch.Tensor], ws: list[torch.Tensor], repeats: int) -> float:
    """Seconds per call of ``fn(x, w)`` over the weight copies, replayed as one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for x, w in zip(xs, ws, strict=True):  # warm-up (Triton compiles here, outside the capture)
            fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(xs[i % len(xs)], ws[i % len(ws)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000 / CALLS)
    return statistics.median(times)


def main() -> None:
    from deepinfer_attention.gemv import gemv

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    results = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-400_000_000 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]
        for m in args.rows:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            err = (gemv(xs[0], ws[0]).float() - F.linear(xs[0], ws[0]).float()).abs().max().item()
            row = {"shape": name, "n": n, "k": k, "rows": m, "max_abs_diff": err}
            row["cublas_us"] = time_graph(F.linear, xs, ws, args.repeats) * 1e6
            row["gemv_us"] = {}
            for bn, bk, target in CONFIGS:
                fn = functools.partial(gemv, block_n=bn, block_k=bk, target=target)
                row["gemv_us"][f"{bn}x{bk}/{target}"] = time_graph(fn, xs, ws, args.repeats) * 1e6
            default = next(iter(row["gemv_us"].values()))
            best = min(row["gemv_us"], key=row["gemv_us"].get)
            tb = n * k * 2 / 1e6  # MB: over µs gives TB/s
            row.update(cublas_tb_s=tb / row["cublas_us"], gemv_tb_s=tb / default, speedup=row["cublas_us"] / default,
                       best=best, best_speedup=row["cublas_us"] / row["gemv_us"][best])
            results.append(row)
            print(f"{name:8s} M={m:2d}: cuBLAS {row['cublas_us']:7.1f} us ({row['cublas_tb_s']:.2f} TB/s)  gemv "
                  f"{default:7.1f} us ({row['gemv_tb_s']:.2f} TB/s) x{row['speedup']:.2f}; best {best} "
                  f"x{row['best_speedup']:.2f}; diff {err:.3g}", flush=True)
        del ws
        torch.cuda.empty_cache()
    if args.output:
        args.output.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                           "date": time.strftime("%Y-%m-%d"), "calls_per_graph": CALLS,
                                           "results": results}, indent=1))


if __name__ == "__main__":
    main()
