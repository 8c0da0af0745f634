"""Structured output and batch-invariant mode costs on CPU with SmolLM2 (docs/benchmarks.md).

    .venv/bin/python scripts/bench_structured.py grammar     # compile times, per-step mask overhead
    .venv/bin/python scripts/bench_structured.py invariant   # tok/s with kernels.batch_invariant off / on

Prints one JSON object. Medians over ``--repeats``; the model is the SmolLM2 alias.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.structured.spec import GrammarSpec

SPECS = {
    "json_small": GrammarSpec("json", json.dumps({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age"]})),
    "json_nested": GrammarSpec("json", json.dumps({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
                 "required": ["id"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}}},
        "required": ["user", "items"]})),
    "regex_phone": GrammarSpec("regex", r"[0-9]{3}-[0-9]{3}-[0-9]{4}"),
    "ebnf_list": GrammarSpec("ebnf", 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'),
    "choice_3": GrammarSpec("choice", json.dumps(["Paris", "London", "Rome"])),
}


def grammar(args: argparse.Namespace) -> dict:
    llm = LLM("smollm2-135m-instruct", kv_cache_bytes=1 << 28, max_model_len=1024)
    compiler = llm.engine._grammar_compiler()
    t0 = time.perf_counter()
    compiler.submit(GrammarSpec("regex", "warm")).result()  # builds the tokenizer info once
    first = time.perf_counter() - t0
    compile_ms, cached_ms = {}, {}
    for name, spec in SPECS.items():
        t0 = time.perf_counter()
        compiler.submit(spec).result()
        compile_ms[name] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        compiler.submit(spec).result()
        cached_ms[name] = (time.perf_counter() - t0) * 1e3
    # Per-step overhead: the same batch of 8 chat prompts, 32 greedy tokens, free vs JSON-constrained.
    chats = [[{"role": "user", "content": f"Describe customer number {i} as JSON."}] for i in range(8)]
    schema = json.loads(SPECS["json_nested"].source)
    free = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    walls: dict[str, list[float]] = {"free": [], "json": []}
    core = llm.engine.core
    for _ in range(args.repeats):
        for mode in ("free", "json"):
            params = free if mode == "free" else SamplingParams(temperature=0, max_tokens=32,
                                                                structured={"json_schema": schema})
            before_s, before_rows = core.structured.mask_fill_seconds, core.structured.masked_rows
            t0 = time.perf_counter()
            outs = llm.chat(chats, params, use_tqdm=False)
            walls[mode].append(time.perf_counter() - t0)
            if mode == "json":
                rows = core.structured.masked_rows - before_rows
                fill_us = (core.structured.mask_fill_seconds - before_s) / max(rows, 1) * 1e6
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    logits = torch.randn(8, llm.engine.model.vocab_size)
    bitmask = compiler.allocate_bitmask(8)
    t0 = time.perf_counter()
    for _ in range(200):
        compiler.apply_bitmask(logits, bitmask, list(range(8)))
    apply_us = (time.perf_counter() - t0) / 200 * 1e6
    llm.shutdown()
    return {"tokenizer_info_and_first_compile_ms": first * 1e3, "compile_ms": compile_ms, "cached_ms": cached_ms,
            "mask_fill_us_per_row": fill_us, "apply_us_per_step_8_rows": apply_us,
            "batch8_32tok_free_s": statistics.median(walls["free"]),
            "batch8_json_s": statistics.median(walls["json"]), "json_tokens": tokens}


def invariant(args: argparse.Namespace) -> dict:
    prompts = [f"Write a short story about a robot named R{i}." for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    result = {}
    for mode in (False, True):
        llm = LLM("smollm2-135m-instruct", kv_cache_bytes=1 << 28, max_model_len=1024,
                  kernels={"batch_invariant": mode})
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
        llm.shutdown()
        result["batch_invariant" if mode else "reference"] = {"output_tok_per_s_median": statistics.median(rates),
                                                               "runs": rates}
    result["ratio"] = (result["batch_invariant"]["output_tok_per_s_median"]
                       / result["reference"]["output_tok_per_s_median"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["grammar", "invariant"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    print(json.dumps(grammar(args) if args.what == "grammar" else invariant(args), indent=2))


if __name__ == "__main__":
    main()
