"""CPU benchmark: deepinfer vs transformers ``generate`` on SmolLM2 with a mixed workload.

Workload: prompts of 32–512 tokens (random token ids drawn from ordinary text tokens), each request
with its own output length in [16, 128] (EOS ignored so both engines do exactly the same work).
deepinfer runs every request with continuous batching at ``max_num_seqs = B``; transformers runs
static batches of B (left-padded), each batch generating up to its longest request; both count only
the tokens the requests asked for. Greedy decoding, fp32, all cores torch gives by default.

    python scripts/bench_cpu.py --batch 1 8 32 --repeats 3 --output bench.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.assets import resolve_model_path


def workload(n: int, seed: int, vocab_lo: int = 200, vocab_hi: int = 40000) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randint(32, 512))], rng.randint(16, 128))
            for _ in range(n)]


def run_deepinfer(llm: LLM, work: list[tuple[list[int], int]]) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(m for _, m in work)
    return seconds, tokens


def run_transformers(model, work: list[tuple[list[int], int]], batch: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        longest = max(m for _, m in chunk)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=0)
        tokens += sum(m for _, m in chunk)
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=0, help="requests per batch size (default max(8, B))")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--output")
    args = ap.parse_args()
    folder = resolve_model_path("smollm2-135m-instruct")
    llm_by_batch = {}
    hf = None
    if not args.skip_transformers:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    for batch in args.batch:
        n = args.requests or max(8, batch)
        work = workload(n, seed=batch)
        llm = llm_by_batch.setdefault(batch, LLM(folder, max_num_seqs=batch, max_model_len=1024,
                                                 kv_cache_bytes=3 << 30))
        run_deepinfer(llm, work[:2])  # warm-up
        ours, theirs = [], []
        for _ in range(args.repeats):
            s, t = run_deepinfer(llm, work)
            ours.append(t / s)
            if hf is not None:
                s, t = run_transformers(hf, work, batch)
                theirs.append(t / s)
        row = {"batch": batch, "requests": n, "output_tokens": sum(m for _, m in work),
               "deepinfer_tok_s": statistics.median(ours), "deepinfer_runs": ours}
        if theirs:
            row |= {"transformers_tok_s": statistics.median(theirs), "transformers_runs": theirs,
                    "speedup": statistics.median(ours) / statistics.median(theirs)}
        results.append(row)
        print(json.dumps(row))
    meta = {"machine": platform.processor() or platform.machine(), "cores": torch.get_num_threads(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "results": results}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(meta, f, indent=2)


if __name__ == "__main__":
    main()
