"""``deepinfer bench``: a workload through the engine (offline or a concurrency sweep), optionally
through the transformers baseline too; JSON report (``docs/bench.md``) and PNG plots."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepinfer.bench import BENCH_SCHEMA
from deepinfer.bench.metrics import acceptance_normalized_throughput
from deepinfer.bench.runner import build_llm, environment, measure, public
from deepinfer.bench.workloads import WorkloadSpec, build_workload, describe, materialize, warmup_workload


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """The workload flags shared by ``bench`` and ``ab``."""
    parser.add_argument("--dataset", default="random",
                        help="random | shared-prefix | repeat | FILE.jsonl (default random)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256, help="mean prompt length in tokens")
    parser.add_argument("--output-len", type=int, default=64, help="mean output length in tokens (EOS ignored)")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="lengths uniform in L*(1 ± r) (default 0: every request the same)")
    parser.add_argument("--prefix-len", type=int, default=None,
                        help="shared-prefix: tokens shared per group (default 3/4 of --input-len)")
    parser.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: number of groups")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (and sampling seeds when T > 0)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default greedy)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, range_ratio=args.range_ratio, prefix_len=args.prefix_len,
                        num_prefixes=args.num_prefixes, seed=args.seed)


def parse_concurrency(text: str | None) -> list[int | None]:
    """``"1,4,16"`` → [1, 4, 16]; ``None`` → [None] (offline: every request queued at once)."""
    if not text:
        return [None]
    values: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        if item in ("inf", "offline"):
            values.append(None)
            continue
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"--concurrency {text!r}: expected comma-separated integers") from None
        if value < 1:
            raise ValueError(f"--concurrency {text!r}: values must be at least 1")
        values.append(value)
    return values


def arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The command's flags as given (the ``arguments`` object of the reports)."""
    return {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | list | type(None))}


def report_head(args: argparse.Namespace, started: str) -> dict[str, Any]:
    """The fields every ``deepinfer bench`` report opens with: schema, start time, flags, environment."""
    return {"schema": BENCH_SCHEMA, "created": started, "arguments": arguments(args), "environment": environment()}


def _row(run: dict[str, Any]) -> str:
    if "request_rate" in run:
        c = f"rate {run['request_rate']}/s"
    else:
        c = "offline" if run["concurrency"] is None else str(run["concurrency"])
    med = {k: run[k]["median"] for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}
    cells = [f"{v:.1f}" if v is not None else "-" for v in med.values()]
    return (f"| {run['engine']} | {c} | {run['request_throughput']:.2f} | {run['output_throughput']:.1f} | "
            + " | ".join(cells) + " |")


def summary_table(runs: list[dict[str, Any]]) -> str:
    lines = ["| engine | load | req/s | output tok/s | TTFT ms | TPOT ms | ITL ms | E2EL ms |",
             "|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [_row(r) for r in runs])


def _write(report: dict[str, Any], output: str | None) -> None:
    if output:
        out = Path(output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")


def run_http_bench(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """``deepinfer bench --url``: the workload against a running server at each ``--request-rate``.
    The local model folder gives the vocabulary and tokenizer to build the same workload."""
    from deepinfer.bench.http import parse_rates, run_http
    from deepinfer.model.assets import resolve_model_path
    from deepinfer.model.loader import read_hf_config
    from deepinfer.tokenizer import Tokenizer

    folder = resolve_model_path(model)
    spec = workload_spec(args)
    tokenizer = Tokenizer(folder) if Tokenizer.exists(folder) else None
    work = materialize(build_workload(spec, read_hf_config(folder)["vocab_size"]), tokenizer)
    served = args.served_model_name or model
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    run_http(args.url, served, work[:2], rate=float("inf"), api_key=args.api_key)  # warm-up, not measured
    runs = [run_http(args.url, served, work, rate=rate, seed=args.seed, api_key=args.api_key)
            for rate in parse_rates(args.request_rate or "inf")]
    report = {**report_head(args, started), "model": str(folder), "url": args.url, "workload": describe(spec, work),
              "runs": runs, "baseline": [], "plots": []}
    _write(report, args.output)
    return report


def run_anchor_bench(args: argparse.Namespace, model: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``deepinfer bench --decode-anchor B,...``: the decode anchor (``bench/anchor.py``) at each batch, and a
    peer's result file (``--baseline-file``) beside it; the report holds both and the markdown table."""
    from deepinfer.bench.anchor import anchor_table, read_peer_anchor, run_anchor

    batches = [c for c in parse_concurrency(args.decode_anchor) if c is not None]
    if not batches:
        raise ValueError("--decode-anchor needs batch sizes, e.g. 1,16,64")
    peer, meta = read_peer_anchor(args.baseline_file) if args.baseline_file else (None, {})
    peer_name = Path(args.baseline_file).stem.split("_")[0] if args.baseline_file else "peer"
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    scheduler = {"max_num_seqs": max(batches), **overrides.get("scheduler", {})}  # room for the largest batch
    llm = build_llm(model, args.config, {**overrides, "scheduler": scheduler})
    ours = run_anchor(llm, batches, repeats=args.repeats, prompt_len=args.input_len, decode_tokens=args.output_len,
                      seed=args.seed + 1000)
    engine = llm.engine
    report = {**report_head(args, started), "model": str(engine.model_path), "device": engine.device.type,
              "dtype": str(engine.dtype).removeprefix("torch."), "decode_anchor": ours,
              "baseline_file": args.baseline_file, "baseline_meta": meta,
              "baseline_anchor": peer, "anchor_table": anchor_table(ours, peer, peer_name)}
    llm.shutdown()
    _write(report, args.output)
    return report


def _llama_cpp_baseline(args: argparse.Namespace, model: str, work: list, points: list, runs: list[dict[str, Any]],
                        engine_ids: list[list[list[int]]]) -> list[dict[str, Any]]:
    """The llama.cpp baseline (``bench/llama_cpp.py``) beside each measured point; appends its runs."""
    import torch

    from deepinfer.bench.llama_cpp import peer_python, run_llama_cpp
    from deepinfer.model.assets import MODEL_ALIASES, fetch_gguf

    if args.temperature > 0:
        raise ValueError("--baseline llama.cpp compares greedy runs; drop --temperature")
    python = peer_python(args.baseline_python)
    if args.baseline_gguf:
        gguf = Path(args.baseline_gguf)
    elif model in MODEL_ALIASES:
        gguf = fetch_gguf(model)
    else:
        raise ValueError(f"--baseline llama.cpp: {model!r} is not a model alias with a GGUF; name the peer's file "
                         "with --baseline-gguf")
    n_ctx = max(len(p) + m for p, m in work) + 16
    dtype = args.baseline_dtype or "q4_1"
    return _peer_comparison(points, runs, engine_ids, args.baseline_batch, dtype, lambda slots, offline: run_llama_cpp(
        python, gguf, work, threads=torch.get_num_threads(), n_ctx=n_ctx, dtype=dtype, slots=slots, offline=offline))


def _vllm_baseline(args: argparse.Namespace, model_path: Path, engine_dtype: str, work: list, points: list,
                   runs: list[dict[str, Any]], engine_ids: list[list[list[int]]]) -> list[dict[str, Any]]:
    """The vLLM baseline (``bench/vllm_baseline.py``) on the folder the engine loaded, beside each measured
    point; appends its runs."""
    import torch

    from deepinfer.bench.vllm_baseline import peer_python, run_vllm

    if args.temperature > 0:
        raise ValueError("--baseline vllm compares greedy runs; drop --temperature")
    python = peer_python(args.baseline_python)
    dtype = args.baseline_dtype or engine_dtype
    max_model_len = max(len(p) + m for p, m in work) + 16
    return _peer_comparison(points, runs, engine_ids, args.baseline_batch, dtype, lambda slots, offline: run_vllm(
        python, model_path, work, dtype=dtype, slots=slots, offline=offline, max_model_len=max_model_len,
        threads=torch.get_num_threads()))


def _peer_comparison(points: list, runs: list[dict[str, Any]], engine_ids: list[list[list[int]]], baseline_batch: int,
                     dtype: str, run_peer: Callable[[int, bool], tuple[dict[str, Any], list[list[int]]]]
                     ) -> list[dict[str, Any]]:
    """``run_peer(slots, offline)`` beside each measured point (its slots the concurrency, or ``baseline_batch``
    offline): appends the peer's runs to ``runs`` and returns the comparison rows."""
    from deepinfer.bench.baseline import token_match

    comparison = []
    for c, ours, ids in zip(points, list(runs), engine_ids, strict=True):
        slots = c if c is not None else baseline_batch
        theirs, their_ids = run_peer(slots, c is None)
        runs.append(theirs)
        comparison.append({"concurrency": c, "baseline_batch_size": slots, "baseline": theirs["engine"],
                           "baseline_dtype": dtype,
                           "output_throughput_ratio": ours["output_throughput"] / theirs["output_throughput"],
                           "token_match": token_match(ids, their_ids)})
    return comparison


def run_bench(args: argparse.Namespace, model: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Everything ``deepinfer bench`` does; returns the report (also written to ``--output``)."""
    if args.url:
        return run_http_bench(args, model)
    if getattr(args, "decode_anchor", None):
        return run_anchor_bench(args, model, overrides)
    if getattr(args, "baseline_file", None):
        raise ValueError("--baseline-file is read with --decode-anchor (a peer's decode-anchor result)")
    points = parse_concurrency(args.concurrency)
    spec = workload_spec(args)
    progress = not args.no_progress
    llm = build_llm(model, args.config, overrides)
    engine = llm.engine
    vocab = engine.intake.vocab_size
    work = materialize(build_workload(spec, vocab), engine.tokenizer)
    model_path, device, dtype = engine.model_path, engine.device, str(engine.dtype).removeprefix("torch.")
    del engine  # each sweep point gets a fresh engine: nothing may keep the previous one's cache alive
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    runs: list[dict[str, Any]] = []
    engine_ids: list[list[list[int]]] = []
    config: dict[str, Any] = {}
    first = [llm]  # handed over to the first measure, so only that call holds the engine
    del llm
    for c in points:
        run, ids, config = measure(model, work, config=args.config, overrides=overrides, concurrency=c,
                                   temperature=args.temperature, seed=args.seed, progress=progress,
                                   desc=f"deepinfer {'offline' if c is None else f'C={c}'}",
                                   llm=first.pop() if first else None)
        if getattr(args, "assumed_acceptance", None) is not None:
            if not (config["plugins"].get("spec_decode") or {}).get("enabled"):
                raise ValueError("--assumed-acceptance needs plugins.spec_decode.enabled=true")
            speculation = config["speculative"]
            if speculation["plan"] != "fixed":
                raise ValueError("--assumed-acceptance normalizes fixed-k runs only (the reference refuses to "
                                 f"normalize {speculation['plan']} ones): set speculative.plan=fixed")
            k = int(speculation["max_draft"])
            run["acceptance_normalized_throughput"] = {
                "label": "extra, not measured: output tok/s at an assumed per-draft acceptance "
                         "(the reference's fixed-k normalization, (1 + k*a) tokens per verify step)",
                "assumed_acceptance": args.assumed_acceptance, "max_draft": k,
                "output_throughput": acceptance_normalized_throughput(run, args.assumed_acceptance, k)}
        runs.append(run)
        engine_ids.append(ids)
    comparison = []
    if args.baseline == "transformers":
        from deepinfer.bench.baseline import load_transformers, run_transformers, token_match

        if args.temperature > 0:
            raise ValueError("--baseline transformers compares greedy runs; drop --temperature")
        hf = load_transformers(model_path, device=device.type, dtype=dtype)
        run_transformers(hf, warmup_workload(vocab), batch_size=2, offline=True, progress=False)
        for c, ours, ids in zip(points, list(runs), engine_ids, strict=True):
            batch = c if c is not None else args.baseline_batch
            theirs, their_ids = run_transformers(hf, work, batch_size=batch, offline=c is None, progress=progress,
                                                 desc=f"transformers B={batch}")
            runs.append(theirs)
            comparison.append({
                "concurrency": c,
                "baseline": theirs["engine"],
                "baseline_batch_size": batch,
                "output_throughput_ratio": ours["output_throughput"] / theirs["output_throughput"],
                "token_match": token_match(ids, their_ids),
            })
        del hf
    elif args.baseline == "llama.cpp":
        comparison = _llama_cpp_baseline(args, model, work, points, runs, engine_ids)
    elif args.baseline == "vllm":
        comparison = _vllm_baseline(args, Path(model_path), dtype, work, points, runs, engine_ids)
    plots = []
    if args.plot:
        from deepinfer.bench.plots import write_plots

        plots = write_plots(runs, args.plot)
    report = {
        **report_head(args, started),
        "model": str(model_path),
        "device": device.type,
        "dtype": dtype,
        "config": config,
        "workload": describe(spec, work),
        "runs": [public(r) for r in runs],
        "baseline": comparison,
        "plots": plots,
    }
    _write(report, args.output)
    return report
