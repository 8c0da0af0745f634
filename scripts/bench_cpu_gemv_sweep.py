"""Rows per task × SIMD lanes of ``plugins/cpu``'s one-row GEMV (``csrc/gemv.c``) over a whole SmolLM2-135M
decode step (issue 36).

Each (ROWS, LANES) pair is compiled with ``-DROWS -DLANES`` and the plugin's other flags; a step is the 121
projections of the model (30 layers' fused q/k/v, o, fused gate/up, down, and the LM head) with *distinct*
weights on huge pages (``huge_pages.HugePageArena``, as the plugin places them), so every call reads memory as
in a decode step (repeated calls on one weight would measure L3). Variants alternate step by step; printed:
the median step time and the bytes it read per second.

    OMP_NUM_THREADS=2 python scripts/bench_cpu_gemv_sweep.py --repeats 5 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from deepinfer_cpu.cbuild import CSRC, FLAGS, compiler
from deepinfer_cpu.huge_pages import HugePageArena

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--lanes", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--sources", type=Path, nargs="+", default=[CSRC / "gemv.c"],
                    help="GEMV sources to compare (default: the plugin's)")
    args = ap.parse_args()
    cc = compiler()
    if cc is None:
        raise SystemExit("needs a C compiler")
    gen = torch.Generator().manual_seed(0)
    arena = HugePageArena()
    weights = [arena.place((torch.randn(n, k, generator=gen) * 0.05).to(getattr(torch, args.dtype)))
               for n, k in SHAPES]
    inputs = {k: torch.randn(k, generator=gen) for k in {k for _, k in SHAPES}}
    outputs = [torch.empty(n) for n, _ in SHAPES]
    calls = [(inputs[w.shape[1]].data_ptr(), w.data_ptr(), o.data_ptr(), w.shape[0], w.shape[1])
             for w, o in zip(weights, outputs, strict=True)]
    total = sum(w.numel() * w.element_size() for w in weights)
    kernels = {}
    with tempfile.TemporaryDirectory() as tmp:
        for source, rows, lanes in itertools.product(args.sources, args.rows, args.lanes):
            target = Path(tmp) / f"gemv_{len(kernels)}.so"
            subprocess.run([cc, *FLAGS, f"-I{CSRC}", f"-DROWS={rows}", f"-DLANES={lanes}", "-o", str(target),
                            str(source), "-lm"], check=True)
            fn = getattr(ctypes.CDLL(str(target)), "gemv_f32" if args.dtype == "float32" else "gemv_bf16")
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int]
            kernels[(source.name, rows, lanes)] = fn
    threads = torch.get_num_threads()

    def step(fn: ctypes._CFuncPtr) -> float:
        start = time.perf_counter()
        for x, w, out, n, k in calls:
            fn(x, w, None, out, n, k, threads)
        return time.perf_counter() - start

    times: dict[tuple[str, int, int], list[float]] = {key: [] for key in kernels}
    for fn in kernels.values():
        step(fn)  # warm
    for _ in range(args.repeats):
        for key, fn in kernels.items():
            times[key].append(step(fn))
    print(f"{len(SHAPES)} projections, {total / 1e6:.0f} MB of {args.dtype} weights, {threads} threads")
    print("| source | rows | lanes | step ms | GB/s |")
    print("|---|---|---|---|---|")
    for (name, rows, lanes), values in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        median = statistics.median(values)
        print(f"| {name} | {rows} | {lanes} | {median * 1e3:.2f} | {total / median / 1e9:.1f} |")


if __name__ == "__main__":
    main()
