"""Eager torch ops and host time per speculative step, split by phase (issue 28).

    python scripts/spec_step_ops.py [--model smollm2-135m-instruct] [--drafters oracle dspark]
        [--plans fixed varlen] [--executors sync overlap] [--batches 1 16] [--steps 16] [--repeats 3]
        [--dspark-weights random|FILE] [--spec FIELD=VALUE ...] [--device cpu|cuda] [--cprofile DIR]
        [--output ops.json]

On the H200 the target's forward and the drafter's passes replay CUDA graphs; everything else in a
speculative step is eager: each op a kernel launch (or a copy) and host time. This counts, per steady
step, the aten ops that reach the dispatcher (a ``TorchDispatchMode`` in every thread that runs a step's
parts: the overlapped executor's device worker too), by phase:

- ``schedule``, ``prepare`` (the host builds the step's tensors: ``plan`` is the verification plan's
  grant inside the scheduler), ``process`` (the host reads the results; ``keep`` the proposal);
- ``run``: the device part around the forward (fills, graph staging), ``followup`` (``FollowUps.apply``),
  ``verify`` / ``sample``, ``draft`` (``Speculator.draft``: the drafter's inputs and the proposal's masks),
  ``drafter`` (the drafter's ``propose`` outside its network: calibration, windows, pending rows);
- ``model`` (the target's forward and LM head) and ``drafter-net`` (dspark's block pass and context
  write): CUDA graphs on the GPU, so they are reported but not in the ``eager`` total.

Ops are counted where they are dispatched, the innermost phase winning; ``views`` are the ones that only
alias (no kernel on a GPU), ``from_lists`` the tensors built from Python lists (one host→device copy each
on CUDA unless packed by ``to_device_many``). Host time (µs per step, the phase's own time without its
inner phases) comes from separate runs without the counter; the median of ``--repeats``.

``--device cuda`` runs the ``attention`` plugin with CUDA graphs (the host times are then the launch path's,
which is what bounds a small model's step there); ``--cprofile DIR`` also writes a ``cProfile`` of the
timed runs' steps per configuration (the calling thread only: under ``overlap`` the device worker is not in
it), ``DIR/NAME.prof`` and the top functions by own time in ``DIR/NAME.txt``.

Workload: ``B`` chat questions, greedy, EOS ignored, prefix caching off, ``--warmup`` steps before the
``--steps`` measured ones (every request decoding throughout). ``oracle`` drafts the recorded greedy reply
with corruption ``1 − --acceptance``; ``dspark`` random weights accept almost nothing, so its ``varlen``
steps are mostly paused decodes (use ``--dspark-weights FILE`` for a trained drafter).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deepinfer.engine.runner as runner_module
from deepinfer import LLM, SamplingParams
from deepinfer.config import set_flags_to_tree
from deepinfer.engine.followup import FollowUps

GRAPHED = ("model", "drafter-net")  # CUDA graphs on the GPU: not eager
TOPICS = ["the ocean", "volcanoes", "honey bees", "the moon", "bread", "chess", "rain", "libraries", "trains",
          "coffee", "mountains", "glass", "tea", "bicycles", "clocks", "rivers"]


class PhaseMeter:
    """Ops and exclusive host seconds per phase, per thread's innermost phase."""

    def __init__(self, count_ops: bool) -> None:
        self.count_ops = count_ops
        self.local = threading.local()
        self.lock = threading.Lock()
        self.ops: Counter[str] = Counter()
        self.views: Counter[str] = Counter()
        self.from_lists: Counter[str] = Counter()
        self.names: dict[str, Counter[str]] = defaultdict(Counter)  # non-view ops by name
        self.seconds: Counter[str] = Counter()
        self.active = False

    def stack(self) -> list[list]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def op(self, name: str, is_view: bool) -> None:
        if not self.active:
            return
        stack = self.stack()
        phase = stack[-1][0] if stack else "other"
        with self.lock:
            self.ops[phase] += 1
            self.views[phase] += is_view
            self.from_lists[phase] += name == "aten.lift_fresh.default"
            if not is_view:
                self.names[phase][name] += 1

    def wrap(self, phase: str, fn: Callable) -> Callable:
        meter = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            stack = meter.stack()
            now = time.perf_counter()
            if stack:
                parent = stack[-1]
                parent[1] += now - parent[2]
            mode = _Counting(meter) if meter.count_ops and not stack else None
            stack.append([phase, 0.0, now])
            try:
                if mode is None:
                    return fn(*args, **kwargs)
                with mode:
                    return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                frame = stack.pop()
                if meter.active:
                    with meter.lock:
                        meter.seconds[phase] += frame[1] + end - frame[2]
                if stack:
                    stack[-1][2] = end

        return wrapped


class _Counting(TorchDispatchMode):
    def __init__(self, meter: PhaseMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)  # lift_fresh (a tensor from a list) aliases its input, but it is a copy on CUDA
        self.meter.op(name, bool(getattr(func, "is_view", False)) and name != "aten.lift_fresh.default")
        return func(*args, **(kwargs or {}))


def instrument(llm: LLM, meter: PhaseMeter) -> Callable[[], None]:
    """Wrap the step's parts of ``llm``'s engine in ``meter``'s phases (instance attributes, and the runner
    module's ``verify`` / ``_sample`` and ``FollowUps.apply`` for the process, ``patch_process_wide``); returns
    the undo of both (a later ``measure`` must not run inside this one's wrappers: their counting mode would
    tax its timings)."""
    engine = llm.engine
    core, speculator, runner = engine.core, engine.speculator, engine.core.runner
    targets = [(core, "schedule", "schedule"), (core, "prepare", "prepare"), (core, "run", "run"),
               (core, "process", "process"), (runner.model, "forward", "model"),
               (runner.model, "compute_logits", "model")]
    if speculator is not None:
        targets += [(speculator, name, phase) for name, phase in
                    (("plan_drafts", "plan"), ("draft", "draft"), ("keep", "keep"))]
        drafter = speculator.drafter
        inner = getattr(drafter, "inner", drafter)  # CalibratedDrafter wraps the drafter
        targets += [(inner, name, "drafter-net") for name in ("draft", "write_context") if hasattr(inner, name)]
        targets += [(drafter, "propose", "drafter")] + ([(inner, "propose", "drafter")] if inner is not drafter else [])
    missing = object()
    saved = [(obj, name, vars(obj).get(name, missing)) for obj, name, _ in targets]
    for obj, name, phase in targets:
        setattr(obj, name, meter.wrap(phase, getattr(obj, name)))
    planner = None
    if speculator is not None:
        planner = engine.scheduler.draft_planner
        engine.scheduler.draft_planner = speculator.plan_drafts  # bound when the engine was built
    unpatch = patch_process_wide(meter)

    def undo() -> None:
        unpatch()
        for obj, name, original in reversed(saved):
            if original is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, original)
        if planner is not None:
            engine.scheduler.draft_planner = planner

    return undo


def patch_process_wide(meter: PhaseMeter) -> Callable[[], None]:
    """Phases of functions the engine reaches through module names; returns the undo."""
    saved = (runner_module.verify, runner_module._sample, FollowUps.apply)
    runner_module.verify = meter.wrap("verify", runner_module.verify)
    runner_module._sample = meter.wrap("sample", runner_module._sample)
    FollowUps.apply = meter.wrap("followup", FollowUps.apply)

    def undo() -> None:
        runner_module.verify, runner_module._sample, FollowUps.apply = saved

    return undo


def _engine(model: str, batch: int, executor: str, spec: dict | None, device: str = "cpu", dtype: str = "auto") -> LLM:
    plugins: dict = {"attention" if device == "cuda" else "cpu": {"enabled": True}}
    if executor == "overlap":
        plugins["scheduling"] = {"enabled": True}
    if spec is not None:
        plugins["spec_decode"] = {"enabled": True, "max_draft": 5, **spec}
    return LLM(model, max_num_seqs=max(batch, 1), max_model_len=1024, device=device, dtype=dtype,
               cache={"kv_cache_bytes": 128 << 20, "prefix_caching": False}, plugins=plugins,
               scheduler={"executor": executor})


def _prompts(llm: LLM, batch: int) -> list[list[int]]:
    tok = llm.engine.tokenizer
    questions = [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}." for i in range(batch)]
    return [tok.encode_chat([{"role": "user", "content": q}])[1] for q in questions]


def measure(llm: LLM, prompts: list[list[int]], warmup: int, steps: int, count_ops: bool,
            profiler: cProfile.Profile | None = None) -> dict:
    """Per-step ops and host µs by phase over ``steps`` steps after ``warmup`` (requests fresh each call),
    those steps also in ``profiler`` when given."""
    meter = PhaseMeter(count_ops)
    undo = instrument(llm, meter)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4 * (warmup + steps) + 64, ignore_eos=True)
    ids = []
    try:
        for p in prompts:
            req = engine.make_request(p, params)
            ids.append(req.request_id)
            engine.add(req)
        for _ in range(warmup):
            engine.step()
        meter.active = True
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        meter.active = False
    finally:
        undo()
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    eager = sum(n for phase, n in meter.ops.items() if phase not in GRAPHED)
    return {"ops": {p: n / steps for p, n in sorted(meter.ops.items())},
            "views": {p: n / steps for p, n in sorted(meter.views.items()) if n},
            "from_lists": {p: n / steps for p, n in sorted(meter.from_lists.items()) if n},
            "eager_ops": eager / steps,
            "eager_views": sum(n for p, n in meter.views.items() if p not in GRAPHED) / steps,
            "eager_from_lists": sum(n for p, n in meter.from_lists.items() if p not in GRAPHED) / steps,
            "host_us": {p: 1e6 * s / steps for p, s in sorted(meter.seconds.items())},
            "eager_host_us": 1e6 * sum(s for p, s in meter.seconds.items() if p not in GRAPHED) / steps,
            "wall_ms": 1e3 * wall / steps,
            "top": {p: meter.names[p].most_common(16) for p in meter.names if p not in GRAPHED}}


def _write_profile(profiler: cProfile.Profile, directory: Path, name: str, steps: int) -> None:
    """``NAME.prof`` and ``NAME.txt`` (the 40 functions with the most own time; µs per step in the header)."""
    directory.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(directory / f"{name}.prof")
    text = io.StringIO()
    print(f"{name}: {steps} profiled steps (divide the times by it)", file=text)
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(r"deepinfer|plugins", 60)
    (directory / f"{name}.txt").write_text(text.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafters", nargs="+", default=["oracle", "dspark"], choices=["oracle", "dspark"])
    ap.add_argument("--plans", nargs="+", default=["fixed", "varlen"], choices=["fixed", "varlen"])
    ap.add_argument("--executors", nargs="+", default=["sync", "overlap"], choices=["sync", "overlap"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median)")
    ap.add_argument("--acceptance", type=float, default=0.7, help="the oracle's acceptance rate")
    ap.add_argument("--dspark-weights", default="random")
    ap.add_argument("--spec", action="append", default=[], metavar="FIELD=VALUE",
                    help="a further plugins.spec_decode field, e.g. dspark_num_layers=2 (repeatable)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cprofile", type=Path, default=None, metavar="DIR",
                    help="write a cProfile of each configuration's timed steps here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="model.dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--top", action="store_true", help="print the most frequent eager ops per phase")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "date": time.strftime("%Y-%m-%d %H:%M"),
                    "torch": torch.__version__, "configs": {}}
    extra = set_flags_to_tree([f"spec_decode.{item}" for item in args.spec]).get("spec_decode", {})
    oracle = Path(tempfile.mkdtemp()) / "oracle.jsonl"
    for batch in args.batches:
        recorder = _engine(args.model, batch, "sync", None, args.device, args.dtype)
        prompts = _prompts(recorder, batch)
        replies = recorder.generate(prompts, SamplingParams(temperature=0, max_tokens=4 * (args.warmup + args.steps)
                                                            + 64, ignore_eos=True), use_tqdm=False)
        oracle.write_text("\n".join(json.dumps({"token_ids": p + list(r.outputs[0].token_ids)})
                                    for p, r in zip(prompts, replies, strict=True)))
        recorder.shutdown()
        del recorder
        for drafter in args.drafters:
            if drafter == "oracle":
                spec = {"drafter": "oracle", "oracle_file": str(oracle), "oracle_corruption": 1.0 - args.acceptance}
            else:
                spec = {"drafter": "dspark", "dspark_weights": args.dspark_weights, **extra}
            for plan in args.plans:
                for executor in args.executors:
                    name = f"{drafter}-{plan}-{executor}-b{batch}"
                    llm = _engine(args.model, batch, executor, {**spec, "plan": plan}, args.device, args.dtype)
                    measure(llm, prompts, args.warmup, args.steps, count_ops=False)  # warm-up
                    counted = measure(llm, prompts, args.warmup, args.steps, count_ops=True)
                    profiler = cProfile.Profile() if args.cprofile else None
                    timed = [measure(llm, prompts, args.warmup, args.steps, count_ops=False, profiler=profiler)
                             for _ in range(args.repeats)]
                    if profiler is not None:
                        _write_profile(profiler, args.cprofile, name, args.steps * max(args.repeats, 1))
                    llm.shutdown()
                    del llm
                    gc.collect()  # the phase wrappers hold the engine in cycles: free it before the next one
                    row = {k: counted[k] for k in ("ops", "views", "from_lists", "eager_ops", "eager_views",
                                                   "eager_from_lists", "top")}
                    timed = timed or [counted]  # --repeats 0: the counted run's times (inflated by the counter)
                    row["host_us"] = {p: statistics.median(t["host_us"].get(p, 0.0) for t in timed)
                                      for p in counted["host_us"]}
                    row["eager_host_us"] = statistics.median(t["eager_host_us"] for t in timed)
                    row["wall_ms"] = statistics.median(t["wall_ms"] for t in timed)
                    report["configs"][name] = row
                    split = " ".join(f"{p}={n:.0f}/{n - row['views'].get(p, 0):.0f}" for p, n in row["ops"].items()
                                     if p not in GRAPHED)
                    print(f"{name:28s} eager ops/step {row['eager_ops']:6.1f} (views {row['eager_views']:.0f}, "
                          f"from lists {row['eager_from_lists']:.0f})  eager host {row['eager_host_us']:7.0f} µs  "
                          f"step {row['wall_ms']:6.1f} ms  | {split}", flush=True)
                    if args.output:  # after every configuration: a long run that is stopped keeps what it measured
                        args.output.write_text(json.dumps(report, indent=1))
                    print("    host µs: " + ", ".join(f"{p}={us:.0f}" for p, us in row["host_us"].items()), flush=True)
                    if args.top:
                        for phase, names in row["top"].items():
                            print(f"    {phase}: " + ", ".join(f"{n.removeprefix('aten.')}×{c / args.steps:.1f}"
                                                             for n, c in names if "view" not in n and "slice" not in n),
                                  flush=True)


if __name__ == "__main__":
    main()
