"""Decode tok/s of SmolLM2 on CPU in float32, bfloat16 and the weight-only ``int8`` / ``q4_1`` formats
(issue 36 item 2; docs/benchmarks.md), measured per engine step so a shared machine's preemptions do not
swamp it.

Per (configuration, batch B): B random-id prompts of ``--input-len`` tokens are queued at once and the engine
stepped (greedy, EOS ignored, ``--output-len`` tokens each); once every request has its first token, every
later step is a decode step of all B rows (no arrivals, no prompt chunks) until they finish. The figure is
B / (median decode step time), per round, from wall time and from the process's CPU time (``--threads 1``:
the CPU time of a step is what it would take alone on a core, whatever else the machine runs, which a
shared VM's wall clock is not); rounds interleave the configurations (fp32, bf16, int8, q4_1, fp32, ...),
and the tables give the median over rounds with the range. The decode anchor's ``t_full − t1`` difference
(``deepinfer bench --decode-anchor``) went negative at batch 32 on this shared 2-core VM, hence the per-step
medians. ``plugins.cpu`` is on in every configuration.

    python scripts/bench_cpu_quant.py --batch 1 8 32 --rounds 3 --output quant.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from deepinfer import LLM, SamplingParams

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "q4_1": {"dtype": "float32", "quantization": "q4_1"},
}


def decode_steps(llm: LLM, batch: int, input_len: int, output_len: int, seed: int) -> list[tuple[float, float]]:
    """The (wall, process CPU) times in s of the decode steps of one batch (module docstring)."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for ids in torch.randint(2, engine.model.vocab_size, (batch, input_len), generator=gen).tolist():
        engine.add(engine.make_request(ids, params))
    start_tokens = engine.stats.generated_tokens
    times = []
    while engine.has_unfinished():
        prefilled = engine.stats.generated_tokens - start_tokens >= batch
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        elapsed = (time.perf_counter() - t0, time.process_time() - c0)
        if prefilled and engine.stats.generated_tokens - start_tokens < batch * output_len:
            times.append(elapsed)  # all rows decoding, none finished yet
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--quant-dense-rows", type=int, default=None,
                    help="plugins.cpu.quant_dense_rows (default: the plugin's)")
    ap.add_argument("--output")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    clocks = ("wall", "cpu")
    results = {clock: {c: {b: [] for b in args.batch} for c in args.configs} for clock in clocks}
    loads = []
    for round_ in range(args.rounds):
        for config in args.configs:
            cpu: dict[str, Any] = {"enabled": True}
            if args.quant_dense_rows is not None:
                cpu["quant_dense_rows"] = args.quant_dense_rows
            llm = LLM("smollm2-135m-instruct", plugins={"cpu": cpu},
                      max_num_seqs=max(args.batch), **CONFIGS[config])
            decode_steps(llm, 1, 16, 4, seed=0)  # warm-up: kernels built, packed weights in place
            for batch in args.batch:
                steps = decode_steps(llm, batch, args.input_len, args.output_len, seed=1000 * round_ + batch)
                for i, clock in enumerate(clocks):
                    results[clock][config][batch].append(batch / statistics.median(s[i] for s in steps))
            llm.shutdown()
            loads.append(os.getloadavg()[0])
            print(f"round {round_ + 1} {config}: " + ", ".join(
                f"B={b} {results['wall'][config][b][-1]:.1f} tok/s wall, {results['cpu'][config][b][-1]:.1f} cpu"
                for b in args.batch) + f" (load {loads[-1]:.2f})", flush=True)

    for clock in clocks:
        table = results[clock]
        print(f"\ndecode tok/s ({clock} time per step)\n| batch | {' | '.join(args.configs)} |")
        print(f"|---|{'---|' * len(args.configs)}")
        for batch in args.batch:
            cells = [f"{statistics.median(table[c][batch]):.1f} ({min(table[c][batch]):.1f}–"
                     f"{max(table[c][batch]):.1f})" for c in args.configs]
            print(f"| {batch} | {' | '.join(cells)} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"arguments": vars(args), "torch_threads": torch.get_num_threads(), "load_1min": loads,
                       "decode_tok_s": {clock: {c: {str(b): v for b, v in r.items()} for c, r in table.items()}
                                        for clock, table in results.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
