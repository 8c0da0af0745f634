"""What one engine step with prompt rows costs beside a decode step (issue 28): host and device.

    python scripts/profile_prompt_step.py [--device cuda] [--batch 15] [--lengths 8 56 256 1000] [--out DIR]

A SmolLM2-shaped dummy model (``scripts/smollm2_shaped.json``, bf16) decodes ``batch`` requests; then, one at
a time, a request with a prompt of each length joins, and the step that carries its prompt rows is timed (wall,
the engine's synchronous executor) beside the decode steps around it. One such step of the last length is run
under ``cProfile`` (top functions by own time to ``DIR/cprofile.txt``) and under ``torch.profiler`` (top ops by
host and by device time to ``DIR/torch_profile.txt``, with its kernel launch count).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import set_flags_to_tree

CONFIG = Path(__file__).with_name("smollm2_shaped.json")


def timed_step(engine) -> float:
    t = time.perf_counter()
    engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=15)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8, 56, 256, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("out/prompt_step"))
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="extra engine config, e.g. kernels.cuda_graphs=false")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp())
    shutil.copy(CONFIG, folder / "config.json")
    plugins = {"attention": {"enabled": True}} if args.device == "cuda" else {}
    overrides = set_flags_to_tree(args.set)
    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", device=args.device, plugins=plugins,
              max_num_seqs=args.batch + 1, kv_cache_bytes=512 << 20, max_model_len=2048, **overrides)
    engine = llm.engine
    rng = random.Random(0)
    vocab = 49152

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    long = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for _ in range(args.batch):
        engine.add(engine.make_request(prompt(100), long))
    for _ in range(4):
        timed_step(engine)  # the batch's prompts, then decoding
    joiner = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    results: dict[int, list[float]] = {}
    decode: list[float] = []
    for _ in range(args.repeats + 1):  # the first round warms every length's kernels up
        for n in args.lengths:
            decode.extend(timed_step(engine) for _ in range(3))
            engine.add(engine.make_request(prompt(n), joiner))
            results.setdefault(n, []).append(timed_step(engine))
    steady = decode[3 * len(args.lengths):]  # after the warm-up round
    print(f"decode step ({args.batch} requests): median {1e3 * statistics.median(steady):.2f} ms")
    for n, times in results.items():
        print(f"step with a {n}-token prompt: median {1e3 * statistics.median(times[1:]):.2f} ms "
              f"(first {1e3 * times[0]:.2f} ms)")
    n = args.lengths[-1]
    for _ in range(3):
        timed_step(engine)
    engine.add(engine.make_request(prompt(n), joiner))
    profiler = cProfile.Profile()
    profiler.enable()
    timed_step(engine)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    (args.out / "cprofile.txt").write_text(text.getvalue())
    for _ in range(3):
        timed_step(engine)
    engine.add(engine.make_request(prompt(n), joiner))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        timed_step(engine)
    averages = prof.key_averages()
    launches = sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch"))
    sort_device = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
    (args.out / "torch_profile.txt").write_text(
        f"kernel launches {launches}\n" + averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n"
        + averages.table(sort_by=sort_device, row_limit=25))
    print(f"kernel launches in the profiled step: {launches}")
    llm.shutdown()


if __name__ == "__main__":
    main()
