"""One-row GEMVs over a whole SmolLM2-135M step's weights on 4 KB pages against huge pages (issue 36).

The 121 projections of a batch-1 decode step (30 layers' q/k/v, o, gate/up and down, and the LM head), each a
distinct weight so every call streams memory, run through ``plugins/cpu``'s GEMV twice per repeat: once on
weights torch allocated (4 KB pages unless ``THP_MEM_ALLOC_ENABLE=1``), once on copies in a
``HugePageArena`` (``huge_pages.py``). Printed: the median step time and the bytes per second, and the
process's AnonHugePages.

    OMP_NUM_THREADS=2 python scripts/bench_cpu_huge_pages.py --repeats 9 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from deepinfer_cpu.gemv import gemv
from deepinfer_cpu.huge_pages import HugePageArena

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    plain = [torch.randn(n, k, generator=gen).to(dtype) for n, k in SHAPES]
    arena = HugePageArena()
    sets = {"4 KB pages": plain, "huge pages": [arena.place(w) for w in plain]}
    rows = {k: torch.randn(1, k, generator=gen).to(dtype) for k in (576, 1536)}
    times: dict[str, list[float]] = {name: [] for name in sets}
    for _ in range(args.repeats):
        for name, weights in sets.items():  # alternating, so drifts of the machine hit both
            start = time.perf_counter()
            for w in weights:
                gemv(rows[w.shape[1]], w)
            times[name].append(time.perf_counter() - start)
    total = sum(w.numel() * w.element_size() for w in plain)
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    huge = [line.split()[1] for line in meminfo if line.startswith("AnonHugePages")]
    print(f"{args.dtype}, {total / 1e6:.0f} MB per step, {torch.get_num_threads()} threads, AnonHugePages {huge} kB")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name}: median {median * 1e3:.2f} ms ({min(values) * 1e3:.2f}–{max(values) * 1e3:.2f}), "
              f"{total / median / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
