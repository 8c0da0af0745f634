"""Speculative decoding on one GPU with CUDA graphs (issue 28): no speculation against ``fixed``-5 and
``varlen`` on the 8-layer DeepSeek-V2-Lite-shaped dummy model, with the ``oracle`` drafter at set
acceptance rates, under the synchronous and the overlapped executor.

    python scripts/bench_gpu_spec.py [--batch 1 16 64 128] [--acceptance 0.5 0.7 0.9] [--repeats 3]
        [--new-tokens 128] [--executors sync overlap] [--dtype bfloat16|float32] [--output spec.json]
        [--profile B [--profile-only]]

Model and routing as ``scripts/bench_gpu_deepseek.py`` (``load_format="dummy"``, bf16 or fp32, forced
balanced routing, the ``attention`` and ``moe`` plugins). Workload per batch ``B`` and repeat: ``B``
fresh random prompts of 65–128 tokens (prefix caching off; distinct lengths so that the
position-hashed balanced routing does not send every row of a decode step to the same experts), greedy,
EOS ignored, ``--new-tokens`` each.

The oracle drafter needs the answer: a first engine without speculation (synchronous) generates every
prompt's greedy reply, which becomes the oracle's file. Each draft is then the known next token,
replaced by a wrong one with probability ``1 − a`` (``oracle_corruption``), so a draft at position i
is accepted with probability ``a^i`` given the greedy path is unchanged; its confidence is ``a`` (and
the plugin calibrates it online). ``a`` is set on the engine's oracle between runs (the bench reaches
into the test drafter; nothing else is changed). Replies that leave the recorded greedy path (bf16
rows verified in other batch shapes can flip a near tie) are counted, and the engine's own acceptance
statistics are reported beside every figure.

Timed per repeat: ``t1`` (the prompts with ``max_tokens=1``) and ``t_full`` (``max_tokens =
new_tokens + 1``, other prompts of the same shape); decode tok/s = ``B · new_tokens / (t_full − t1)``,
median over repeats. One untimed call per (batch, acceptance) first: it also profiles ``varlen``'s
step-cost curve. Engines are built one after another (one alive at a time). Reported beside each
figure: mean acceptance length, verified drafts per verify step, and the device's idle fraction
between steps (``get_stats()``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu_deepseek import CONFIG, copy_bandwidth, profile_steps, step_bytes

PROMPT_LEN = 128


def _prompts(batch: int, repeat: int, kind: str) -> list[list[int]]:
    from deepinfer.bench.anchor import anchor_prompts

    offset = {"warm": 0, "t1": 1, "full": 2}[kind]
    prompts = anchor_prompts(batch, 100_000 * batch + 10 * (repeat + 1) + offset, CONFIG["vocab_size"], PROMPT_LEN)
    # Lengths 65…128: balanced routing hashes the position, so prompts of one length would decode in lockstep
    # with every row of a step routed to the same experts (a no-spec step 1.9× cheaper than a real one at B=16).
    return [p[:PROMPT_LEN - (37 * i) % (PROMPT_LEN // 2)] for i, p in enumerate(prompts)]


def _workloads(batches: list[int], repeats: int) -> list[tuple[int, int, str]]:
    """(batch, repeat, kind) of every call: per batch one untimed call, then ``t1`` and ``full`` per repeat."""
    calls = []
    for batch in batches:
        calls.append((batch, -1, "warm"))
        calls += [(batch, repeat, kind) for repeat in range(repeats) for kind in ("t1", "full")]
    return calls


def _build(folder: Path, max_batch: int, executor: str, spec: dict | None, dtype: str):
    from deepinfer import LLM

    plugins = {"attention": {"enabled": True}, "moe": {"enabled": True}}
    if executor == "overlap":
        plugins["scheduling"] = {"enabled": True}
    if spec is not None:
        plugins["spec_decode"] = {"enabled": True, **spec}
    return LLM(str(folder), load_format="dummy", dtype=dtype, device="cuda",
               kernels={"force_balanced_routing": True}, scheduler={"executor": executor},
               cache={"kv_cache_bytes": 8 << 30, "prefix_caching": False}, max_num_seqs=max_batch,
               max_num_batched_tokens=max(4096, max_batch * PROMPT_LEN), plugins=plugins)


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [list(o.outputs[0].token_ids) for o in outs]


def _free(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def record_greedy(folder: Path, batches: list[int], repeats: int, new_tokens: int, oracle: Path, dtype: str) -> dict:
    """The greedy reply of every prompt of the run (max_tokens = new_tokens + 1), as the oracle's file."""
    llm = _build(folder, max(batches), "sync", None, dtype)
    replies = {}
    with oracle.open("w") as f:
        for batch, repeat, kind in _workloads(batches, repeats):
            prompts = _prompts(batch, repeat, kind)
            _, outs = _generate(llm, prompts, new_tokens + 1)
            replies[(batch, repeat, kind)] = outs
            for p, o in zip(prompts, outs, strict=True):
                f.write(json.dumps({"token_ids": p + o}) + "\n")
    _free(llm)
    return replies


def measure(llm, batches: list[int], repeats: int, new_tokens: int, replies: dict, rates: list[float | None]) -> dict:
    """Decode tok/s of ``llm`` at every batch and acceptance rate (None: an engine without speculation)."""
    drafter = getattr(getattr(llm.engine, "speculator", None), "drafter", None)
    rows = {}
    for batch in batches:
        for rate in rates:
            if rate is not None:
                drafter.inner.corruption = 1.0 - rate
            t1s, fulls, off_path = [], [], 0
            for b, repeat, kind in _workloads([batch], repeats):
                seconds, outs = _generate(llm, _prompts(b, repeat, kind), 1 if kind == "t1" else new_tokens + 1)
                if kind == "warm":  # every batch's first call: the counters start after it
                    before = llm.get_stats()
                    continue
                (t1s if kind == "t1" else fulls).append(seconds)
                if kind == "full":
                    off_path += sum(o != r for o, r in zip(outs, replies[(b, repeat, kind)], strict=True))
            after = llm.get_stats()
            decode = [batch * new_tokens / (f - t) for t, f in zip(t1s, fulls, strict=True)]
            busy = after["device_busy_s"] - before["device_busy_s"]
            idle = after["device_idle_s"] - before["device_idle_s"]
            row = {"decode_tok_s": decode, "decode_tok_s_median": statistics.median(decode),
                   "device_idle_fraction": idle / (busy + idle) if busy + idle else 0.0,
                   "replies_off_the_greedy_path": off_path}
            spec_before, spec_after = before.get("spec_decode") or {}, after.get("spec_decode")
            if spec_after:  # the counters are the engine's totals: this measurement's share by difference
                verifies = spec_after["verify_steps"] - spec_before.get("verify_steps", 0)
                emitted = (spec_after["mean_acceptance_length"] * spec_after["verify_steps"]
                           - spec_before.get("mean_acceptance_length", 0.0) * spec_before.get("verify_steps", 0))
                row["verify_steps"] = verifies
                row["mean_acceptance_length"] = emitted / verifies if verifies else 0.0
                row["spec_totals"] = spec_after
            if after.get("step_cost"):
                row["step_cost"] = after["step_cost"]
            rows[f"{batch}/{rate}"] = row
            print(json.dumps({"batch": batch, "acceptance": rate, **{k: v for k, v in row.items()
                                                                     if k != "spec_totals"}}), flush=True)
    return rows


def profile_spec(llm, batch: int, new_tokens: int, out: Path) -> None:
    """``torch.profiler`` over 12 steady decode steps at ``batch`` (see the module docstring)."""
    from deepinfer import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens + 1, ignore_eos=True)
    for prompt in _prompts(batch, 0, "full"):
        engine.add(engine.make_request(prompt, params))
    steps = 12  # after the prefill and 4 decode steps: drafts, calibration and pauses under way
    averages, wall = profile_steps(engine, 5, steps)
    device_us = sum(e.self_device_time_total for e in averages)
    table = averages.table(sort_by="self_device_time_total", row_limit=30)
    out.write_text(f"batch {batch}: {steps} steps, wall {1e3 * wall / steps:.2f} ms per step, device kernels "
                   f"{device_us / 1e3 / steps:.2f} ms per step\n{table}\n")
    print(out.read_text().splitlines()[0], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-draft", type=int, default=5)
    ap.add_argument("--executors", nargs="+", default=["sync", "overlap"], choices=["sync", "overlap"])
    ap.add_argument("--plans", nargs="+", default=["fixed", "varlen"], choices=["fixed", "varlen"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32: verified rows in other batch shapes leave the recorded greedy path far less often")
    ap.add_argument("--output", type=Path)
    ap.add_argument("--profile", type=int, default=None, metavar="B", help="profile 12 decode steps at batch B")
    ap.add_argument("--profile-only", action="store_true", help="with --profile: no timed runs")
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "config": CONFIG, "args": vars(args) | {"output": str(args.output)},
              "copy_bandwidth_bytes_s": copy_bandwidth(), "runs": {}}
    if args.dtype == "bfloat16":  # the bandwidth limit of a decode step without speculation (bf16 bytes)
        report["limit_tok_s"] = {b: b * report["copy_bandwidth_bytes_s"]
                                 / step_bytes(b, PROMPT_LEN + args.new_tokens / 2)["total_bytes"] for b in args.batch}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(CONFIG))
        oracle = folder / "oracle.jsonl"
        t = time.perf_counter()
        replies = record_greedy(folder, args.batch, args.repeats, args.new_tokens, oracle, args.dtype)
        print(f"greedy replies recorded in {time.perf_counter() - t:.1f} s", flush=True)
        for executor in args.executors:
            for plan in [None, *args.plans]:
                spec = None if plan is None else {"drafter": "oracle", "oracle_file": str(oracle), "plan": plan,
                                                  "max_draft": args.max_draft}
                name = f"{executor}/{plan or 'off'}"
                t = time.perf_counter()
                llm = _build(folder, max(args.batch), executor, spec, args.dtype)
                print(f"{name}: built in {time.perf_counter() - t:.1f} s", flush=True)
                rates = [None] if plan is None else args.acceptance
                if args.profile is not None:
                    if plan is not None:
                        llm.engine.speculator.drafter.inner.corruption = 1.0 - args.acceptance[0]
                    where = args.output.parent if args.output else Path(".")
                    profile_spec(llm, args.profile, args.new_tokens, where / f"profile-{executor}-{plan or 'off'}.txt")
                if not args.profile_only:
                    report["runs"][name] = measure(llm, args.batch, args.repeats, args.new_tokens, replies, rates)
                _free(llm)
                if args.output:
                    args.output.write_text(json.dumps(report, indent=1, default=str))
    for executor in args.executors if not args.profile_only else ():
        for batch in args.batch:
            off = report["runs"][f"{executor}/off"][f"{batch}/None"]["decode_tok_s_median"]
            cells = [f"off {off:.0f}"]
            for rate in args.acceptance:
                for plan in args.plans:
                    row = report["runs"][f"{executor}/{plan}"][f"{batch}/{rate}"]
                    cells.append(f"{plan}@{rate} {row['decode_tok_s_median'] / off:.2f}x")
            print(f"{executor} B={batch}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
