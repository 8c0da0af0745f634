"""Where a CPU decode step's time goes on SmolLM2 with ``plugins.cpu`` (issue 36).

Three measurements, each less sensitive to a shared machine than the one before:

- ``tpot``: end-to-end time per output token of greedy chat requests, one at a time (``--batch 1``) or
  ``--batch`` copies together; the median over the requests; ``--dump`` writes the token ids.
- ``forward``: one captured decode step (forward + LM head on its last row) replayed ``--steps`` times
  per repeat; the median over repeats of the wall time and of the process's CPU time (at one thread the
  latter barely moves with the load of other processes). ``--stub`` makes the GEMV and attention C calls no-ops, which
  leaves the step's Python and small torch ops: the overhead the issue is about.
- ``counts``: top-level aten ops (``torch.profiler``) and Python function calls (``cProfile``) per
  captured step: deterministic, whatever else the machine runs.

    OMP_NUM_THREADS=2 python scripts/bench_cpu_step.py tpot --threads 1 2 --repeats 3
    python scripts/bench_cpu_step.py forward --threads 1 --stub
    python scripts/bench_cpu_step.py counts
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections import Counter

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model import base

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain why the sky is blue in three sentences.",
           "List five uses of a paperclip."]


def tpot(llm: LLM, batch: int, tokens: int, repeats: int) -> tuple[list[float], list[list[int]]]:
    """Per-request milliseconds per output token after the first, and the last repeat's token ids."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    times, ids = [], []
    for _ in range(repeats):
        ids = []
        for i in range(len(PROMPTS)):
            chats = [[{"role": "user", "content": PROMPTS[(i + j) % len(PROMPTS)]}] for j in range(batch)]
            out = llm.chat(chats, params, use_tqdm=False)[0]
            m = out.metrics
            times.append((m.finish_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1) * 1e3)
            ids.append(list(out.outputs[0].token_ids))
    return times, ids


def captured_step(llm: LLM, batch: int):
    """A function replaying one decode step of ``batch`` rows (forward + LM head on the last row)."""
    seen = {}
    forward = base.StackedDecoderLM.forward

    def record(model, input_ids, ctx):
        if ctx.num_decodes == input_ids.numel() == batch and not seen:
            seen["step"] = (model, input_ids.clone(), ctx)
        return forward(model, input_ids, ctx)

    base.StackedDecoderLM.forward = record
    try:
        llm.generate(["The quick brown fox jumps over the lazy dog. " * 4] * batch,
                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        base.StackedDecoderLM.forward = forward
    model, ids, ctx = seen["step"]

    @torch.inference_mode()
    def step() -> torch.Tensor:
        return model.compute_logits(model.forward(ids, ctx)[-1:], ctx)
    return step


def stub_kernels() -> None:
    """Make the plugin's GEMV and attention C calls no-ops (``--stub``)."""
    import deepinfer_cpu.gemv as gemv
    import deepinfer_cpu.paged_attention as attention

    def noop(*args):
        return 0
    gemv._kernels = lambda: (noop, noop)
    attention._paged_attention = lambda: noop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["tpot", "forward", "counts"])
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64, help="tpot: output tokens per request")
    ap.add_argument("--steps", type=int, default=30, help="forward: steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stub", action="store_true", help="forward: GEMV and attention C calls as no-ops")
    ap.add_argument("--dump", help="tpot: write the token ids here (JSON)")
    args = ap.parse_args()
    llm = LLM("smollm2-135m-instruct", plugins={"cpu": {"enabled": True}}, max_num_seqs=max(args.batch, 1))
    if args.mode == "counts":
        step = captured_step(llm, args.batch)
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        top = [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [step() for _ in range(10)])
        print(f"batch={args.batch} top-level aten ops per step: {len(top)}; Python calls per step: "
              f"{pstats.Stats(profiler).total_calls / 10:.0f}; most common: {Counter(top).most_common(8)}")
        return
    step = captured_step(llm, args.batch) if args.mode == "forward" else None
    if args.stub:
        stub_kernels()
    for threads in args.threads:
        torch.set_num_threads(threads)
        if step is not None:
            for _ in range(10):
                step()
            times, cpu = [], []
            for _ in range(args.repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    step()
                times.append((time.perf_counter() - t0) / args.steps * 1e3)
                cpu.append((time.process_time() - c0) / args.steps * 1e3)
            # CPU time of the process: at one thread, the step's own work, whatever else the machine runs.
            print(f"forward threads={threads} batch={args.batch}{' stub' if args.stub else ''}: process CPU time "
                  f"median {statistics.median(cpu):.2f} ms, min {min(cpu):.2f}")
        else:
            tpot(llm, args.batch, 4, 1)  # warm-up
            times, ids = tpot(llm, args.batch, args.tokens, args.repeats)
            if args.dump:
                with open(args.dump, "w") as f:
                    json.dump(ids, f)
        print(f"{args.mode} threads={threads} batch={args.batch}{' stub' if args.stub else ''}: median "
              f"{statistics.median(times):.2f} ms, min {min(times):.2f}, all {' '.join(f'{t:.1f}' for t in times)}")


if __name__ == "__main__":
    main()
