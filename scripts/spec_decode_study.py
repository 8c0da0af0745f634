"""Speculative decoding, measured (issue 4): real acceptance on SmolLM2, a step-cost curve, a simulation.

    python scripts/spec_decode_study.py measure --output docs/bench/spec_cpu.json [--repeats 3]
    python scripts/spec_decode_study.py curve --output docs/bench/step_cost_h200.json [--max-tokens 1536]
    python scripts/spec_decode_study.py simulate --traces docs/bench/spec_cpu.json \
        --curve docs/bench/step_cost_h200.json --output docs/bench/spec_sim.json

``measure``: SmolLM2-135M-Instruct on this machine, greedy chat requests that ask the model to repeat,
quote or lightly rewrite a paragraph (repetition the ``ngram`` drafter can exploit), 64 new tokens,
at batch 1 (requests one after another) and batch 16 (all at once): output tokens/s with speculation
off, ``fixed`` and ``varlen`` (``ngram``, max_draft 5), median of ``--repeats`` interleaved runs, plus
the acceptance statistics; and the per-request verify traces of a ``fixed`` run (calibrated
confidences per position and how many drafts were accepted), the input of ``simulate``.

``curve``: the step-cost curve (seconds per forward vs query tokens) of the 8-layer DeepSeek-V2-Lite-
shaped dummy V3 model of ``bench_gpu_deepseek.py`` on the current device (bf16 on CUDA), measured the
way the engine's ``StepCost`` does.

``simulate``: for batch sizes 1…256, draw requests from the traces (their confidences and the number
of drafts they would get accepted if all were verified), let each plan choose what to verify, and
compute expected output tokens per second of step time from the curve: no speculation, ``fixed``
(every draft) and ``varlen``. Greedy acceptance is a property of the draft and the target alone, so a
request accepts ``min(accepted, verified)`` drafts whatever the plan verifies.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

PARAGRAPHS = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors may borrow up to five "
    "books at a time, and each loan lasts three weeks. Late returns cost ten cents per day.",
    "To make the bread, mix the flour with water and salt, then add the yeast. Knead the dough for ten minutes, "
    "let it rest for an hour, shape it into a loaf and bake it for forty minutes.",
    "The train leaves the central station every hour on the hour. It stops at the airport, the university and "
    "the harbour before it reaches the old town, where the line ends.",
    "Our team meets every Monday to review the week's plan. Each member reports what was finished, what is "
    "blocked and what comes next. The meeting never lasts more than thirty minutes.",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is lower, "
    "so water boils at a lower temperature and food takes longer to cook.",
    "The garden has three beds: tomatoes in the first, beans in the second and herbs in the third. Each bed is "
    "watered in the early morning, before the sun gets too strong.",
    "Please send the report by Friday. Include the sales figures for each region, the list of new customers "
    "and a short summary of the problems we saw this quarter.",
    "The museum shows paintings from the sixteenth to the nineteenth century. The east wing holds portraits, "
    "the west wing holds landscapes, and the top floor hosts visiting exhibitions.",
]
TASKS = ["Repeat the following text exactly, nothing else:\n{}",
         "Copy this paragraph word for word:\n{}",
         "Quote the text below in full, then stop:\n{}",
         "Rewrite the following text with the same words, one sentence per line:\n{}"]


def conversations(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": TASKS[i % len(TASKS)].format(PARAGRAPHS[i % len(PARAGRAPHS)])}]
            for i in range(n)]


def _spec(plan: str | None) -> dict:
    if plan is None:
        return {}
    return {"spec_decode": {"enabled": True, "drafter": "ngram", "plan": plan, "max_draft": 5}}


def _run(llm, convs, params, batch: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(convs), batch):
        outs = llm.chat(convs[i:i + batch], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return time.perf_counter() - t0, tokens


def measure(args: argparse.Namespace) -> dict:
    from deepinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=64)
    plans = [None, "fixed", "varlen"]
    engines = {plan: LLM("smollm2-135m-instruct", plugins=_spec(plan)) for plan in plans}
    results: dict = {"machine": args.machine, "date": time.strftime("%Y-%m-%d"), "model": "smollm2-135m-instruct",
                     "max_tokens": 64, "max_draft": 5, "drafter": "ngram", "runs": {}}
    for batch, count in ((1, 4), (16, 16)):
        convs = conversations(count)
        for plan in plans:  # warm-up (and the varlen step-cost profile) outside the timed runs
            _run(engines[plan], convs[:batch], params, batch)
        samples: dict = {str(p): [] for p in plans}
        for _ in range(args.repeats):
            for plan in plans:
                secs, tokens = _run(engines[plan], convs, params, batch)
                samples[str(plan)].append(tokens / secs)
        results["runs"][f"batch{batch}"] = {plan: {"tok_per_s_median": statistics.median(v), "tok_per_s": v}
                                           for plan, v in samples.items()}
        print(f"batch {batch}:", {p: round(statistics.median(v), 1) for p, v in samples.items()}, flush=True)
    for plan in ("fixed", "varlen"):
        results[f"stats_{plan}"] = engines[plan].get_stats()["spec_decode"]
    # Traces: a fresh fixed run with every verify step recorded.
    tracer = LLM("smollm2-135m-instruct", plugins=_spec("fixed"))
    traces: list[dict] = []
    inner = tracer.engine.core.on_step_end

    def record(stats) -> None:
        for v, a, conf in zip(stats.verified_drafts, stats.accepted_drafts, stats.draft_confidence, strict=True):
            traces.append({"verified": v, "accepted": a, "confidence": list(conf)})
        if inner is not None:
            inner(stats)

    tracer.engine.core.on_step_end = record
    _run(tracer, conversations(32), params, 16)
    results["traces"] = traces
    return results


def curve(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_gpu_deepseek import CONFIG

    from deepinfer import LLM
    from deepinfer.engine.cost import profile_sizes, time_call

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(CONFIG))
        llm = LLM(folder, load_format="dummy", kernels={"force_balanced_routing": True}, max_model_len=4096,
                  plugins=json.loads(args.plugins))
        engine = llm.engine
        points = []
        for q in profile_sizes(args.max_tokens):
            secs = time_call(lambda q=q: engine.runner.placeholder_step(q), engine.device, warmup=2, repeats=7)
            points.append((q, secs))
            print(q, f"{secs * 1e3:.2f} ms", flush=True)
        backends = {op: type(b).__name__ for op, b in engine.runner.backends.items()}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "date": time.strftime("%Y-%m-%d"), "model": "8-layer V2-Lite-shaped dummy V3, bf16",
            "backends": backends, "points": points}


def simulate(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(Path(__file__).parents[1] / "plugins" / "spec_decode"))
    from deepinfer_spec_decode.plans import FixedPlan, VarlenPlan

    from deepinfer.engine.cost import StepCost

    traces = [t for t in json.loads(Path(args.traces).read_text())["traces"] if t["verified"] == 5]
    measured = {int(q): s for q, s in json.loads(Path(args.curve).read_text())["points"]}
    cost = StepCost(measured.__getitem__, max(measured), sizes=list(measured))
    rng = random.Random(0)
    table = []
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        sums = {"none": [0.0, 0.0], "fixed": [0.0, 0.0], "varlen": [0.0, 0.0]}
        for _ in range(args.rounds):
            picks = [rng.choice(traces) for _ in range(batch)]
            conf = torch.tensor([p["confidence"] for p in picks], dtype=torch.float32)
            accepted = torch.tensor([p["accepted"] for p in picks])
            for name, plan in (("fixed", FixedPlan()), ("varlen", VarlenPlan())):
                total = plan.budget(conf, cost)
                verified = plan.split(conf, total)
                sums[name][0] += float((torch.minimum(accepted, verified) + 1).sum())
                sums[name][1] += cost.step_time(total)
            sums["none"][0] += batch
            sums["none"][1] += cost.step_time(batch)
        row = {"batch": batch, **{k: v[0] / v[1] for k, v in sums.items()}}
        row["varlen_over_fixed"] = row["varlen"] / row["fixed"]
        row["fixed_over_none"] = row["fixed"] / row["none"]
        row["varlen_over_none"] = row["varlen"] / row["none"]
        table.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return {"traces": len(traces), "rounds": args.rounds, "table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--machine", default="2-core CPU VM")
    c = sub.add_parser("curve")
    c.add_argument("--max-tokens", type=int, default=1536)
    c.add_argument("--plugins", default="{}", help='plugins section as JSON, e.g. \'{"moe": {"enabled": true}}\'')
    s = sub.add_parser("simulate")
    s.add_argument("--traces", required=True)
    s.add_argument("--curve", required=True)
    s.add_argument("--rounds", type=int, default=200)
    for p in (m, c, s):
        p.add_argument("--output", required=True)
    args = parser.parse_args()
    result = {"measure": measure, "curve": curve, "simulate": simulate}[args.command](args)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
