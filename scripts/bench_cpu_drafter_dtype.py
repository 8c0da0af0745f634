"""A trained ``dspark`` drafter beside the float32 SmolLM2 target on CPU, its ``dspark_dtype`` float32 against
bfloat16 (issues 26 and 28).

    python scripts/bench_cpu_drafter_dtype.py WEIGHTS [--repeats 3] [--output out.json]

Batch 1, synchronous executor, the chat prompts of ``bench_cpu_spec_overlap.py`` (6), greedy, 96 tokens each;
configurations: no speculation, ``fixed``-5 and ``varlen`` with the drafter in each dtype (2 layers, window 64:
the CPU-trained drafter's shape); one engine each, all alive, warmed up once, repeats interleaved. Reports output
tok/s (median), acceptance, and the step-cost model's drafting time per request. Outputs must equal no
speculation's token for token.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu_spec_overlap import _engine, _prompts

from deepinfer import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Output tok/s of the prompts one after another, and the replies."""
    start, count, replies = time.perf_counter(), 0, []
    for prompt in prompts:
        reply = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        replies.append(reply)
        count += len(reply)
    return count / (time.perf_counter() - start), replies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("weights")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    base = {"drafter": "dspark", "dspark_weights": args.weights, "dspark_num_layers": 2, "dspark_context_window": 64}
    configs: dict[str, dict | None] = {"off": None}
    for dtype in ("float32", "bfloat16"):
        for plan in ("fixed", "varlen"):
            configs[f"{plan}-{dtype}"] = {**base, "plan": plan, "dspark_dtype": dtype}
    llms = {name: _engine(MODEL, 1, "sync", spec) for name, spec in configs.items()}
    prompts = _prompts(llms["off"], 6)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    for llm in llms.values():
        _run(llm, prompts, params)  # warm-up: the step-cost curve, the packed weights
    speeds: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(args.repeats):
        reference = None
        for name, llm in llms.items():
            tok_s, replies = _run(llm, prompts, params)
            speeds[name].append(tok_s)
            reference = replies if reference is None else reference
            assert replies == reference, f"{name}: outputs differ from no speculation"
    result = {}
    for name, llm in llms.items():
        stats = llm.get_stats()
        spec, cost = stats.get("spec_decode", {}), stats.get("step_cost", {})
        result[name] = {"tok_s": statistics.median(speeds[name]), "runs": speeds[name],
                        "acceptance": spec.get("mean_acceptance_length"), "verify_steps": spec.get("verify_steps"),
                        "draft_ms_per_request": 1e3 * (cost.get("draft_seconds_per_request") or 0.0)}
        print(name, json.dumps(result[name]), flush=True)
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
