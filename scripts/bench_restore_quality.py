"""Quality of bounded state restore on real weights: Gemma-3-270M, real text (issue 8).

    python scripts/bench_restore_quality.py [--lengths 1024 2048 4096 8192] [--keep 513 1024 2048]
        [--scored 32] [--output restore.json]

For each prompt length L: a real-text prompt of L tokens (CPython's source files, concatenated)
is prefilled once so its full blocks sit in the prefix cache; then the same prompt is sent again and
its next ``--scored`` tokens are teacher-forced to the text's own continuation while the logits of
every step are recorded. With an exact restore the prefix hit is used as is (Gemma-3 keeps full
paged KV, so exact needs no replay); with ``restore: bounded`` the last ``keep_tokens`` cached
tokens are recomputed with every sliding window blind below the first replayed token. Reported per
(L, keep): the mean and max KL(exact ‖ bounded) of the next-token distributions, and their top-1
agreement. A cold run (prefix caching off) checks that the exact restore equals no cache at all.
"""

from __future__ import annotations

import argparse
import gc
import json
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.sampling.sampler import SampleResult


def real_text_ids(llm: LLM, count: int) -> list[int]:
    """``count`` token ids of real English/Python text: the standard library's sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text, ids = "", []
    for name in ("json/__init__.py", "json/decoder.py", "argparse.py", "textwrap.py", "dataclasses.py",
                 "functools.py", "inspect.py"):
        text += (stdlib / name).read_text(encoding="utf-8")
        ids = llm.engine.tokenizer.encode_prompt(text)
        if len(ids) >= count:
            return ids[:count]
    raise RuntimeError(f"not enough text for {count} tokens")


def forced_logits(llm: LLM, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """``[len(forced), vocab]`` float32 logits of the steps after ``prompt``, with each sampled token
    replaced by ``forced`` (teacher forcing), so exact and bounded runs see the same history."""
    runner, model = llm.engine.runner, llm.engine.model
    execute, compute = runner.execute, model.compute_logits
    rows: list[torch.Tensor] = []

    def keep(hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        logits = compute(hidden, ctx)
        if logits.shape[0]:  # a prefill chunk that samples nothing computes no rows
            rows.append(logits[-1].float().cpu())
        return logits

    def force(inputs: Any, fill: Any = None) -> Any:
        results = execute(inputs, fill)
        step = len(rows) - 1
        if results.sampled is not None and step < len(forced):
            tokens = results.sampled.tokens.clone()
            tokens[0] = forced[step]
            results.sampled = SampleResult(tokens)
        return results

    runner.execute, model.compute_logits = force, keep
    try:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=len(forced), ignore_eos=True),
                     use_tqdm=False)
    finally:
        runner.execute, model.compute_logits = execute, compute
    return torch.stack(rows[:len(forced)])


def run(length: int, keep: int | None, scored: int, text: list[int], prefix_caching: bool = True) -> torch.Tensor:
    """Logits of the scored steps after a prefix-cache hit restored exactly (``keep`` None) or bounded
    (without prefix caching: recomputed from scratch)."""
    replay = {"restore": "bounded", "keep_tokens": keep} if keep is not None else {}
    llm = LLM("gemma-3-270m", max_model_len=length + scored + 16, max_num_batched_tokens=2048,
              cache={"prefix_caching": prefix_caching, "kv_cache_bytes": 1 << 30},
              plugins={"attention": {"enabled": True, "replay": replay}})
    try:
        prompt = text[:length]
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # fill the cache
        return forced_logits(llm, prompt, text[length:length + scored])
    finally:
        llm.shutdown()
        del llm
        gc.collect()  # one engine at a time: each holds the weights and its KV cache


def compare(exact: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    logp, logq = torch.log_softmax(exact, -1), torch.log_softmax(other, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
            "top1_agreement": (exact.argmax(-1) == other.argmax(-1)).float().mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--keep", type=int, nargs="+", default=[513, 1024, 2048])
    parser.add_argument("--scored", type=int, default=32)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    probe = LLM("gemma-3-270m")
    text = real_text_ids(probe, max(args.lengths) + args.scored)
    probe.shutdown()
    results = []
    for length in args.lengths:
        t0 = time.perf_counter()
        exact = run(length, None, args.scored, text)
        cold = compare(exact, run(length, None, args.scored, text, prefix_caching=False))
        print(json.dumps({"length": length, "exact_vs_no_cache": cold}), flush=True)
        results.append({"length": length, "keep_tokens": None, **cold})
        for keep in args.keep:
            if keep >= length:
                continue
            row = {"length": length, "keep_tokens": keep, **compare(exact, run(length, keep, args.scored, text))}
            results.append(row)
            print(json.dumps(row), flush=True)
        print(f"L={length}: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.output:
        args.output.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "scored": args.scored,
                                           "results": results}, indent=1))


if __name__ == "__main__":
    main()
