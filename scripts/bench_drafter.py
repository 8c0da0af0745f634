"""Speculative decoding with a trained ``dspark`` drafter, measured (issue 27).

    python scripts/bench_drafter.py --model smollm2-135m-instruct --work WORK_DIR \
        [--batches 1 8 32] [--repeats 3] [--max-tokens 128] [--output docs/bench/drafter_smollm2.json]

``WORK_DIR`` is the training run's work folder (``<weights>.work``, holding ``data.pt`` or at least
``replies-held-out.json``): its held-out
prompts (passages and templates the training never saw) are the workload, and the weights file beside
it is the drafter (``--weights F`` another one; ``--spec FIELD=VALUE`` further drafter settings). For
each batch size (requests at once; batch 1 runs them one after another) the configurations
``off``, ``fixed`` (``max_draft`` 5) and ``varlen`` (``--configs``: a subset) run interleaved, greedy,
until EOS or ``--max-tokens``; at batch 1 on the CPU outputs must be token-identical across configurations (elsewhere
the replies that differ are counted: the GEMMs are not batch-invariant, see the loop). Reported: output tokens/s
(median of ``--repeats``), the engine's acceptance statistics (mean acceptance length, acceptance by
position, calibrated ECE), and at batch 1 the median wall time of one engine step (a plain decode step
against a verify + draft step). Every configuration runs the ``cpu`` plugin's GEMMs (``--core-gemm``:
the core's torch GEMM instead; ``--device cuda``: the ``attention`` plugin's backends and CUDA graphs) and,
with ``--overlap``, the ``scheduling`` plugin's overlapped executor. ``--profile CONFIG`` (CUDA) adds a
``torch.profiler`` table of 16 steady steps of that configuration at each batch (host and device time by op,
kernel launches, graph replays and copies per step). Before the timings every configuration runs the batch
once (32 tokens; on the GPU the whole workload), so its CUDA graphs, the drafter's included, are captured outside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import set_flags_to_tree


def _configs(weights: Path, plugins: dict, extra: dict) -> dict[str, dict]:
    spec = {"enabled": True, "drafter": "dspark", "max_draft": 5, "dspark_weights": str(weights), **extra}
    return {"off": plugins,
            "fixed": {**plugins, "spec_decode": {**spec, "plan": "fixed"}},
            "varlen": {**plugins, "spec_decode": {**spec, "plan": "varlen"}}}


def _run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, list, list[float]]:
    """(seconds, outputs, step seconds) for ``prompts`` at ``batch`` requests in flight."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    engine = llm.engine
    outputs: dict[str, list[int]] = {}
    step_times: list[float] = []
    start = time.perf_counter()
    pending = list(prompts)
    order = []
    while pending or engine.has_unfinished():
        while pending and len(order) - len(outputs) < batch:  # keep `batch` requests in flight
            req = engine.make_request(pending.pop(0), params)
            order.append(req.request_id)
            engine.add(req)
        t = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        step_times.append(time.perf_counter() - t)
    return time.perf_counter() - start, [outputs[r] for r in order], step_times


def profile_config(llm: LLM, prompts: list[list[int]], batch: int, out: Path) -> dict:
    """``torch.profiler`` over 16 steady steps of ``batch`` requests (after 6 warm-up steps): the top ops by
    host time and by device time written to ``out``; per step: wall ms, kernel launches, graph replays and
    host → device copies. The steps' timeline (every thread's ops and the kernels) goes beside it as a gzipped
    Chrome trace."""
    from bench_gpu_deepseek import profile_steps

    engine, steps = llm.engine, 16
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for p in prompts[:batch]:
        engine.add(engine.make_request(p, params))
    averages, wall = profile_steps(engine, 6, steps, trace=out.with_suffix(".trace.json.gz"))
    out.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=30) + "\n"
                   + averages.table(sort_by="self_device_time_total", row_limit=20))
    counts = {e.key: e.count / steps for e in averages
              if e.key in ("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cuLaunchKernel")}
    return {"wall_ms_per_step": 1e3 * wall / steps, "per_step": counts, "table": out.name}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts-per-batch", type=int, nargs="+", default=None,
                    help="held-out prompts run at each batch size (default: 8 at batch 1, else 2 x batch; cycled "
                         "when the held-out set has fewer)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--core-gemm", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the attention plugin's backends and CUDA graphs instead of the cpu plugin")
    ap.add_argument("--overlap", action="store_true", help="every configuration on the overlapped executor")
    ap.add_argument("--kv-cache-mb", type=int, default=512, help="KV cache per engine (three live at once)")
    ap.add_argument("--weights", type=Path, default=None, help="the drafter (default: the file beside --work)")
    ap.add_argument("--spec", action="append", default=[], metavar="FIELD=VALUE",
                    help="a further plugins.spec_decode field, e.g. dspark_context_window=1 (repeatable)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="an engine setting for every configuration, e.g. kernels.compile=inductor (repeatable)")
    ap.add_argument("--configs", nargs="+", default=["off", "fixed", "varlen"], choices=["off", "fixed", "varlen"],
                    help="the configurations to run (off is the speed-ups' baseline and always runs)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run (seconds): how soon a thread waiting for the GIL gets it "
                         "(the interpreter's default is 0.005); the host and the device thread share it")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--profile", default=None, choices=["off", "fixed", "varlen"],
                    help="with --device cuda: torch.profiler over 16 steady steps of this configuration at each batch, "
                         "after the timings (tables beside --output)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if (args.work / "data.pt").exists():
        held = torch.load(args.work / "data.pt", weights_only=False)["held_seqs"]
        prompts = [ids[:p] for ids, p in zip(held.token_ids, held.prompt_lens, strict=True)]
    else:  # a run whose labelled data stayed on another machine: its held-out replies checkpoint
        prompts = json.loads((args.work / "replies-held-out.json").read_text())["prompts"]
    weights = args.weights or args.work.with_suffix(".safetensors")
    extra = set_flags_to_tree([f"spec_decode.{item}" for item in args.spec]).get("spec_decode", {})
    if args.device == "cuda":
        plugins = {"attention": {"enabled": True}}
    else:
        plugins = {} if args.core_gemm else {"cpu": {"enabled": True}}
    if args.overlap:
        plugins["scheduling"] = {"enabled": True}
    engine = set_flags_to_tree(args.set)
    if args.overlap:  # named: on a CPU device scheduler.executor auto is the synchronous one
        engine.setdefault("scheduler", {})["executor"] = "overlap"
    engine.update(engine.pop("model", {}))  # model.* as flat overrides: LLM's first argument is the model
    for name, section in engine.pop("plugins", {}).items():
        plugins[name] = {**plugins.get(name, {}), **section}
    counts = args.prompts_per_batch or [8 if b == 1 else 2 * b for b in args.batches]
    report: dict = {"model": args.model, "weights": str(weights), "spec": extra, "engine": args.set,
                    "max_tokens": args.max_tokens,
                    "threads": args.threads, "overlap": args.overlap, "device": args.device,
                    "date": time.strftime("%Y-%m-%d"), "batches": {}}
    for batch, count in zip(args.batches, counts, strict=True):
        work = [prompts[i % len(prompts)] for i in range(count)]  # past the held-out set: its prompts again
        llms = {name: LLM(args.model, plugins=cfg, max_num_seqs=max(batch, 1), device=args.device,
                        kv_cache_bytes=args.kv_cache_mb << 20, max_model_len=2048, **engine)
                for name, cfg in _configs(weights, plugins, extra).items() if name == "off" or name in args.configs}
        for llm in llms.values():  # warm-up: first-call costs (packing, calibration, the drafter's graphs) untimed;
            # on the GPU the whole workload, so every graph bucket it reaches (the tail's too) is captured
            _run(llm, work, batch, args.max_tokens) if args.device == "cuda" else _run(llm, work[:batch], batch, 32)
        seconds: dict[str, list[float]] = {n: [] for n in llms}
        steps: dict[str, list[float]] = {n: [] for n in llms}
        reference = None
        tokens = 0
        off_reference: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, llm in llms.items():
                dt, outs, step_times = _run(llm, work, batch, args.max_tokens)
                if reference is None:
                    reference, tokens = outs, sum(len(o) for o in outs)
                differ = sum(o != r for o, r in zip(outs, reference, strict=True))
                if args.device == "cpu" and batch == 1:
                    assert not differ, f"{name} at batch {batch}: outputs differ from the first configuration"
                # Counted, not asserted: on the GPU a prefix-cache hit or another batch shape can flip a near tie; on
                # the CPU from batch 2 a step that mixes a prompt chunk with other requests' rows runs them through
                # oneDNN (min_rows or more rows), not the GEMV, and the configurations mix different steps
                off_reference[name] = off_reference.get(name, 0) + differ
                seconds[name].append(dt)
                steps[name].extend(step_times)
        row = {"prompts": count, "output_tokens": tokens, "dtype": str(llms["off"].engine.dtype).removeprefix("torch.")}
        for name, llm in llms.items():
            med = statistics.median(seconds[name])
            row[name] = {"tok_s": tokens / med, "seconds": seconds[name], "outputs_differing": off_reference[name],
                         "median_step_ms": 1e3 * statistics.median(steps[name])}
            stats = llm.get_stats()
            if stats.get("spec_decode"):
                row[name]["spec"] = stats["spec_decode"]
            if stats.get("step_cost"):
                row[name]["step_cost"] = stats["step_cost"]
            # Where a step's time goes (totals over warm-up and repeats: read them as shares): the host's phases,
            # the device's busy and idle time, and under --overlap the device thread's busy time and the host's
            # waits on it.
            row[name]["time_split"] = {"steps": stats["steps"], **stats["step_time_split"],
                                       "device_busy_s": stats["device_busy_s"], "device_idle_s": stats["device_idle_s"],
                                       **{f"executor_{k}": v for k, v in stats.get("scheduling", {}).items()}}
        for name in set(llms) - {"off"}:
            row[name]["speedup"] = row[name]["tok_s"] / row["off"]["tok_s"]
        report["batches"][str(batch)] = row
        if args.profile and args.device == "cuda":
            where = (args.output or Path("drafter.json")).with_suffix("")
            name = f"{where.name}-profile-{args.profile}-b{batch}.txt"
            row[args.profile]["profile"] = profile_config(llms[args.profile], work, batch, where.parent / name)
        print(json.dumps({"batch": batch, **{n: {k: v for k, v in row[n].items() if k != "seconds"}
                                              for n in llms}}, indent=1), flush=True)
        for llm in llms.values():
            llm.shutdown()
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
