"""The ``cpu_paged`` attention kernel (``plugins/cpu/deepinfer_cpu/csrc/paged_attention.c``) against its source at
another commit, on the same calls (docs/benchmarks.md, issues 28 and 36).

    python scripts/bench_cpu_attention.py --against HEAD~1 [--threads 2] [--calls 300]

Both sources are built with the plugin's flags (``cbuild.FLAGS``) into a temporary folder and called through
ctypes on SmolLM2's heads (9 query, 3 KV, dim 64, bf16 cache, blocks of 16) for decode, verification and prompt-chunk
shapes; printed: the median µs of ``--calls`` calls of one layer each, and whether the outputs are bitwise equal.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from deepinfer_cpu.cbuild import CSRC, FLAGS, compiler

CASES = [(1, 300, 1), (6, 300, 1), (6, 1000, 1), (16, 300, 1), (6, 300, 4), (1, 300, 8), (1, 1000, 32)]


def _build(folder: Path, name: str, source: str) -> ctypes._CFuncPtr:
    for header in CSRC.glob("*.h"):
        (folder / header.name).write_bytes(header.read_bytes())
    (folder / f"{name}.c").write_text(source)
    subprocess.run([compiler(), *FLAGS, "-o", str(folder / f"{name}.so"), str(folder / f"{name}.c"), "-lm"], check=True)
    fn = ctypes.CDLL(str(folder / f"{name}.so")).paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int] + [ctypes.c_void_p] * 3
                   + [ctypes.c_int64, ctypes.c_int])
    return fn


def _time(fn: ctypes._CFuncPtr, rows: int, context: int, requests: int, threads: int, calls: int
          ) -> tuple[float, torch.Tensor]:
    heads, kv_heads, dim, block = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    width = -(-context // block) + 1
    k_cache, v_cache = (torch.randn(requests * width, block, kv_heads, dim, generator=gen).bfloat16() for _ in "kv")
    tables = torch.arange(requests * width).view(requests, width)
    lens = torch.full((requests,), context)
    starts = torch.arange(requests + 1) * rows
    q = torch.randn(requests * rows, heads, dim, generator=gen)
    out = torch.empty_like(q)
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), starts.data_ptr(),
            None, out.data_ptr(), requests, heads, kv_heads, dim, block, width, 0, dim ** -0.5, threads, None, None,
            None, 0, 1)
    fn(*args)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="the commit whose kernel source is the baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    source = CSRC / "paged_attention.c"
    path = source.resolve().relative_to(Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"],
                                                                      text=True).strip()))
    before = subprocess.check_output(["git", "show", f"{args.against}:{path}"], text=True)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"before": _build(Path(tmp), "before", before),
                   "after": _build(Path(tmp), "after", source.read_text())}
        for rows, context, requests in CASES:
            (t0, o0), (t1, o1) = (_time(kernels[k], rows, context, requests, args.threads, args.calls)
                                  for k in ("before", "after"))
            print(f"{rows} rows x {requests} requests, {context} keys: before {t0:.1f} us, after {t1:.1f} us, "
                  f"outputs {'bitwise equal' if torch.equal(o0, o1) else 'differ'}")


if __name__ == "__main__":
    main()
