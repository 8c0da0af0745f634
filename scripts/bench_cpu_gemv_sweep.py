"""``plugins/cpu``'s GEMV (``csrc/gemv.c``) over a whole SmolLM2-135M step's projections, at 1–8 input rows,
against oneDNN's packed GEMM on the same rows (issues 36 and 28).

A step is the model's 121 projections (30 layers' fused q/k/v, o, fused gate/up, down, and the LM head) with
*distinct* weights on huge pages (``huge_pages.HugePageArena``, as the plugin places them), so every call reads
memory as in a decode step (repeated calls on one weight would measure L3). A verification step of k drafts
runs k + 1 rows. ``--sources`` compares GEMV variants (compiled with the plugin's flags; default: the plugin's
own); variants alternate step by step. Printed: per row count, the median step time of each variant and the
bytes it read per second.

    OMP_NUM_THREADS=2 python scripts/bench_cpu_gemv_sweep.py --repeats 5 [--dtype bfloat16] [--sources A.c B.c]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from deepinfer_cpu.cbuild import CSRC, FLAGS, compiler
from deepinfer_cpu.huge_pages import HugePageArena

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def time_interleaved(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Each variant run once to warm up, then ``repeats`` rounds of every variant in turn (so drifts of the
    machine hit all alike); the seconds of each run, per variant."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values():
        run()
    for _ in range(repeats):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    ap.add_argument("--sources", type=Path, nargs="+", default=[CSRC / "gemv.c"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--no-onednn", action="store_true", help="leave oneDNN's packed GEMM out")
    args = ap.parse_args()
    cc = compiler()
    if cc is None:
        raise SystemExit("needs a C compiler")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    arena = HugePageArena()
    weights = [arena.place((torch.randn(n, k, generator=gen) * 0.05).to(dtype)) for n, k in SHAPES]
    total = sum(w.numel() * w.element_size() for w in weights)
    threads = torch.get_num_threads()
    kernels = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, source in enumerate(args.sources):
            target = Path(tmp) / f"gemv_{i}.so"
            subprocess.run([cc, *FLAGS, f"-I{CSRC}", "-o", str(target), str(source), "-lm"], check=True)
            fn = getattr(ctypes.CDLL(str(target)), "gemv_f32" if args.dtype == "float32" else "gemv_bf16")
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
            kernels[f"gemv {source.name}"] = fn
    packed = [] if args.no_onednn else [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    print(f"{len(SHAPES)} projections, {total / 1e6:.0f} MB of {args.dtype} weights, {threads} threads")
    print("| rows | variant | step ms | GB/s |")
    print("|---|---|---|---|")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in SHAPES}}
        outputs = [torch.empty(rows, n) for n, _ in SHAPES]
        variants: dict[str, Callable[[], None]] = {}
        for name, fn in kernels.items():
            calls = [(inputs[w.shape[1]].data_ptr(), w.data_ptr(), o.data_ptr(), rows, w.shape[0], w.shape[1])
                     for w, o in zip(weights, outputs, strict=True)]

            def run(fn: ctypes._CFuncPtr = fn, calls: list = calls) -> None:
                for x, w, out, m, n, k in calls:
                    fn(x, w, None, out, m, n, k, threads)
            variants[name] = run
        if packed:
            typed = {k: v.to(dtype) for k, v in inputs.items()}

            def onednn(typed: dict = typed) -> None:
                for w, p in zip(weights, packed, strict=True):
                    torch.ops.mkldnn._linear_pointwise(typed[w.shape[1]], p, None, "none", [], "")
            variants["oneDNN packed"] = onednn
        for name, values in time_interleaved(variants, args.repeats).items():
            median = statistics.median(values)
            print(f"| {rows} | {name} | {median * 1e3:.2f} | {total / median / 1e9:.1f} |")


if __name__ == "__main__":
    main()
