"""Where a speculative run's time goes, step by step (issue 28).

    python scripts/gpu_step_times.py --work WORK_DIR --weights W.safetensors [--batch 16] [--prompts 32]
        [--configs off fixed varlen] [--device cuda|cpu] [--max-tokens 128] [--spec FIELD=VALUE ...]
        [--profile-prompt-steps DIR]

The workload, configurations and warm-up of ``scripts/bench_drafter.py`` (its held-out prompts, ``batch``
requests in flight, greedy, the whole workload once before the timed run), then one timed run per
configuration with every engine step's wall time and its batch: query tokens, requests, and how many of
them bring prompt rows. Printed per configuration: the run's seconds, the steps with prompt rows (on the GPU
they run eagerly, outside the CUDA graphs) and the decode steps, each count with its total and mean time,
the slowest steps, the decode steps' median time by the number of requests, Python's garbage-collection
time, and the step-cost model's terms.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import runpy
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from deepinfer import LLM
from deepinfer.config import set_flags_to_tree


class GcClock:
    """Seconds spent in Python's garbage collector since ``reset``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def reset(self) -> None:
        self.seconds = 0.0


def timed_run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int, run: Callable,
              profile: Path | None = None) -> tuple[float, list]:
    """``bench_drafter``'s ``run`` of the workload with each engine step's batch recorded: the run's seconds and,
    per engine step, ``(seconds, (query tokens, requests, prompt rows) or None)`` (None: a step that processed no
    batch). ``profile``: every step runs under ``cProfile`` (slower), and the steps with prompt rows' functions,
    by own and by cumulative time, are written there."""
    engine, core = llm.engine, llm.engine.core
    process, step = core.process, engine.step
    shapes: list[tuple[int, int, int]] = []
    per_step: list[tuple[int, int, int] | None] = []

    def recording(scheduled, results):
        out = process(scheduled, results)
        b = scheduled.batch
        prompt_rows = sum(1 for s in b.scheduled if not (s.samples and s.num_new_tokens == 1 + s.draft_rows))
        shapes.append((b.num_tokens, len(b.scheduled), prompt_rows))
        return out

    prompt_steps: list[cProfile.Profile] = []

    def stepping():
        seen = len(shapes)
        profiler = cProfile.Profile() if profile is not None else None
        if profiler is not None:
            profiler.enable()
        outs = step()
        if profiler is not None:
            profiler.disable()
        per_step.append(shapes[-1] if len(shapes) > seen else None)
        if profiler is not None and per_step[-1] is not None and per_step[-1][2]:
            prompt_steps.append(profiler)
        return outs

    core.process, engine.step = recording, stepping
    try:
        seconds, _, times = run(llm, prompts, batch, max_tokens)
    finally:
        del core.process, engine.step  # the instances' own methods again
    if profile is not None and prompt_steps:
        text = io.StringIO()
        stats = pstats.Stats(*prompt_steps, stream=text)
        text.write(f"{len(prompt_steps)} steps with prompt rows\n")
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)
        profile.write_text(text.getvalue())
    return seconds, list(zip(times, per_step, strict=True))


def report(name: str, batch: int, seconds: float, steps: list, gc_seconds: float, cost: dict) -> None:
    times = sorted(s for s, _ in steps)
    print(f"== {name} batch {batch}: {seconds:.3f} s, {len(steps)} steps, median {1e3 * statistics.median(times):.2f} "
          f"ms, p90 {1e3 * times[int(0.9 * len(times))]:.2f} ms, max {1e3 * times[-1]:.2f} ms, gc {gc_seconds:.3f} s")
    kinds: dict[str, list[float]] = {"with prompt rows": [], "decode": [], "no batch": []}
    by_requests: dict[int, list[float]] = {}
    for s, shape in steps:
        kind = "no batch" if shape is None else "with prompt rows" if shape[2] else "decode"
        kinds[kind].append(s)
        if kind == "decode":
            by_requests.setdefault(shape[1], []).append(s)
    for kind, values in kinds.items():
        if values:
            print(f"   {kind}: {len(values)} steps, {sum(values):.3f} s, mean {1e3 * sum(values) / len(values):.2f} ms")
    slowest = sorted(steps, key=lambda x: -x[0])[:12]
    print("   slowest (ms, (query tokens, requests, prompt rows)):",
          [(round(1e3 * s, 2), shape) for s, shape in slowest])
    print("   decode steps by requests (count, median ms):",
          {r: (len(v), round(1e3 * statistics.median(v), 2)) for r, v in sorted(by_requests.items())})
    if cost:
        print("   step cost:", json.dumps({k: v for k, v in cost.items() if k != "curve_seconds"}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--weights", required=True, type=Path)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=["off", "fixed", "varlen"], choices=["off", "fixed", "varlen"])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--spec", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--profile-prompt-steps", type=Path, default=None, metavar="DIR",
                    help="cProfile every step; the steps with prompt rows go to DIR/<config>.txt")
    args = ap.parse_args()
    if args.profile_prompt_steps is not None:
        args.profile_prompt_steps.mkdir(parents=True, exist_ok=True)
    bench = runpy.run_path(str(Path(__file__).with_name("bench_drafter.py")))
    prompts = json.loads((args.work / "replies-held-out.json").read_text())["prompts"][:args.prompts]
    extra = set_flags_to_tree([f"spec_decode.{item}" for item in args.spec]).get("spec_decode", {})
    plugins = {"attention": {"enabled": True}} if args.device == "cuda" else {"cpu": {"enabled": True}}
    configs = bench["_configs"](args.weights, plugins, extra)
    clock = GcClock()
    for name in args.configs:
        llm = LLM(args.model, plugins=configs[name], max_num_seqs=args.batch, device=args.device,
                  kv_cache_bytes=512 << 20, max_model_len=2048)
        bench["_run"](llm, prompts, args.batch, args.max_tokens)  # warm-up: the whole workload
        clock.reset()
        profile = args.profile_prompt_steps / f"{name}.txt" if args.profile_prompt_steps is not None else None
        seconds, steps = timed_run(llm, prompts, args.batch, args.max_tokens, bench["_run"], profile)
        report(name, args.batch, seconds, steps, clock.seconds, llm.get_stats().get("step_cost", {}))
        llm.shutdown()


if __name__ == "__main__":
    main()
