"""Synchronous vs overlapped executor on CPU: throughput, time split of a step, device idle time.

For the synchronous executor the device is idle while the host schedules, prepares and processes,
so its idle fraction is host time / step time. For the overlapped executor the device worker's busy
intervals are recorded (``get_stats()["scheduling"]``) and idle is the gap between them.

    python scripts/bench_overlap.py --batch 1 32 --repeats 3 --output docs/bench_overlap_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from deepinfer import LLM, SamplingParams
from deepinfer.model.assets import resolve_model_path

HOST_PHASES = ("schedule", "prepare", "sample", "process")


def workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 40000) for _ in range(rng.randint(32, 128))] for _ in range(n)]


def measure(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    before = llm.get_stats()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.get_stats()
    split = {k: after["step_time_split"][k] - before["step_time_split"][k] for k in after["step_time_split"]}
    row = {"tok_s": len(prompts) * max_tokens / seconds, "seconds": seconds,
           "steps": after["steps"] - before["steps"], "split_s": split}
    if "scheduling" in after:
        busy = after["scheduling"]["device_busy_s"] - before.get("scheduling", {}).get("device_busy_s", 0.0)
        idle = after["scheduling"]["device_idle_s"] - before.get("scheduling", {}).get("device_idle_s", 0.0)
        row["device_idle_fraction"] = idle / (busy + idle)
    else:
        host = sum(split[k] for k in HOST_PHASES)
        row["device_idle_fraction"] = host / (host + split["forward"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output")
    args = ap.parse_args()
    folder = resolve_model_path("smollm2-135m-instruct")
    results = []
    for batch in args.batch:
        llms = {name: LLM(folder, max_num_seqs=batch, max_model_len=512, kv_cache_bytes=1 << 30,
                          plugins={"scheduling": {"enabled": name == "overlap"}}, scheduler={"executor": name})
                for name in ("sync", "overlap")}
        runs: dict[str, list[dict]] = {name: [] for name in llms}
        for llm in llms.values():
            measure(llm, workload(batch, 0), 4)  # warm-up
        for r in range(args.repeats):
            prompts = workload(batch, r + 1)
            for name, llm in llms.items():  # interleaved
                runs[name].append(measure(llm, prompts, args.max_tokens))
        row = {"batch": batch}
        for name, rs in runs.items():
            row[name] = {"tok_s": statistics.median(x["tok_s"] for x in rs),
                         "device_idle_fraction": statistics.median(x["device_idle_fraction"] for x in rs),
                         "runs": rs}
        row["speedup"] = row["overlap"]["tok_s"] / row["sync"]["tok_s"]
        results.append(row)
        print(json.dumps({k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "runs"})
                          for k, v in row.items()}))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
