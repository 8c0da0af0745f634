"""``deepinfer ab --a SPEC --b SPEC``: compare two configurations on one workload.

A SPEC is a config file (YAML/JSON) or comma-separated ``section.field=value`` overrides (an empty
SPEC is the defaults); either is layered over the command's own ``--config``/``--set``. Each
configuration runs in its own worker process (``deepinfer.bench.worker``); runs are interleaved
A B A B … over ``--repeats``, each on a fresh engine with its own warm-up, after ``--warmup`` discarded
pairs. ``--fresh-process`` starts a new worker for every run instead of one per configuration.
Every run uses the same token-id workload and seeds. The report gives, per metric, both medians, the
B/A ratio of medians with a bootstrap confidence interval (``deepinfer.bench.stats``), a verdict only
when the interval excludes 1, and whether the outputs were token-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from deepinfer.bench import AB_SCHEMA
from deepinfer.bench.command import arguments, workload_spec
from deepinfer.bench.runner import environment
from deepinfer.bench.stats import DEFAULT_RESAMPLES, DEFAULT_SEED, compare
from deepinfer.bench.worker import MARKER
from deepinfer.bench.workloads import build_workload, describe, materialize
from deepinfer.errors import DeepInferError

# (run field, median sub-field or None, unit, higher is better)
METRICS: tuple[tuple[str, str | None, str, bool], ...] = (
    ("output_throughput", None, "tok/s", True),
    ("request_throughput", None, "req/s", True),
    ("ttft_ms", "median", "ms", False),
    ("tpot_ms", "median", "ms", False),
    ("itl_ms", "median", "ms", False),
    ("e2el_ms", "median", "ms", False),
    ("duration_s", None, "s", False),
)


class ABRunError(DeepInferError):
    """A worker failed or exited; the message carries the tail of its log."""


_SPLIT = re.compile(r",(?=\s*[A-Za-z_][\w-]*(?:\.[\w-]+)+\s*=)")


def parse_spec(spec: str) -> dict[str, Any]:
    """A SPEC as ``{"spec", "config", "overrides"}``: a file path, or comma-separated assignments."""
    from deepinfer.config import set_flags_to_tree

    text = spec.strip()
    if text and Path(text).is_file():
        return {"spec": spec, "config": str(Path(text).resolve()), "overrides": {}}
    items = [s.strip() for s in _SPLIT.split(text) if s.strip()] if text else []
    return {"spec": spec, "config": None, "overrides": set_flags_to_tree(items)}


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


class _Worker:
    def __init__(self, label: str, cmd: list[str], log: Path) -> None:
        self.label = label
        self.log_path = log
        self.log = log.open("a")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=os.environ.copy())

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(MARKER):
                reply = json.loads(line[len(MARKER):])
                if "error" in reply:
                    raise ABRunError(f"configuration {self.label} failed: {reply['error']}\n{self._tail()}")
                return reply
        raise ABRunError(f"the worker of configuration {self.label} exited "
                           f"(status {self.proc.wait()})\n{self._tail()}")

    def _tail(self) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-20:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("exit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _value(run: Mapping[str, Any], field: str, sub: str | None) -> float:
    v = run[field]
    return float(v[sub] if sub is not None else v)


def token_identity(a_ids: list[list[list[int]]], b_ids: list[list[list[int]]]) -> dict[str, Any]:
    """Whether every run's outputs equal the first A run's, within each side and across."""
    ref = a_ids[0]

    def same(runs: list[list[list[int]]]) -> bool:
        return all(r == runs[0] for r in runs)

    mismatched = sum(1 for x, y in zip(ref, b_ids[0], strict=True) if x != y)
    within_a, within_b = same(a_ids), same(b_ids)
    a_vs_b = ref == b_ids[0]
    return {"identical": within_a and within_b and a_vs_b, "within_a": within_a, "within_b": within_b,
            "a_vs_b": a_vs_b, "mismatched_requests": mismatched, "num_requests": len(ref)}


def markdown(report: Mapping[str, Any]) -> str:
    w = report["workload"]
    ident = report["token_identity"]
    lines = [
        "# deepinfer ab",
        "",
        f"- model: `{report['model']}`",
        f"- A: `{report['a']['spec']}`",
        f"- B: `{report['b']['spec']}`",
        f"- workload: {w['dataset']}, {w['num_prompts']} requests, {w['total_input_tokens']} input / "
        f"{w['total_output_tokens']} output tokens, seed {w['seed']}; concurrency "
        f"{report['concurrency'] if report['concurrency'] is not None else 'offline'}",
        f"- {report['repeats']} repeats per side, interleaved A B A B, {report['warmup']} warm-up pair(s) "
        f"discarded; bootstrap {report['bootstrap']['confidence']:.0%} CI of the median ratio "
        f"({report['bootstrap']['resamples']} resamples, seed {report['bootstrap']['seed']})",
        "",
        "| metric | A median | B median | B/A | 95% CI | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for m in report["metrics"]:
        unit = f" ({m['unit']})" if m["unit"] else ""
        lines.append(f"| {m['name']}{unit} | {m['a_median']:.4g} | {m['b_median']:.4g} | {m['ratio']:.3f} | "
                     f"[{m['ci_low']:.3f}, {m['ci_high']:.3f}] | {m['verdict'] or 'no significant difference'} |")
    lines += ["", "Outputs token-identical: " + (
        "**yes** (every run of A and B)" if ident["identical"] else
        f"**no** (within A: {ident['within_a']}, within B: {ident['within_b']}, A vs B: "
        f"{ident['mismatched_requests']} of {ident['num_requests']} requests differ)"), ""]
    return "\n".join(lines)


def run_ab(args: argparse.Namespace, model: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Everything ``deepinfer ab`` does; returns the report (written to ``--output`` .json and .md)."""
    from deepinfer.config import build_config
    from deepinfer.model.assets import resolve_model_path
    from deepinfer.model.loader import read_hf_config
    from deepinfer.plugins import config_aliases, discover_plugins
    from deepinfer.tokenizer import Tokenizer

    if args.repeats < 2:
        raise ValueError("--repeats must be at least 2 (the bootstrap needs several runs per side)")
    concurrency = args.concurrency
    if concurrency is not None and concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    sides = {"a": parse_spec(args.a), "b": parse_spec(args.b)}
    aliases = config_aliases(discover_plugins())
    for label, side in sides.items():
        side["overrides"] = _merge(overrides, side["overrides"])
        side["config"] = side["config"] or (str(Path(args.config).resolve()) if args.config else None)
        try:  # fail here, naming the side, rather than in a worker
            build_config(config=side["config"], overrides={**side["overrides"], "model": {
                **side["overrides"].get("model", {}), "path": model}}, aliases=aliases)
        except Exception as exc:
            raise ValueError(f"--{label} {side['spec']!r}: {exc}") from None
    model_path = resolve_model_path(model)
    vocab = int(read_hf_config(model_path)["vocab_size"])
    tokenizer = Tokenizer(model_path) if Tokenizer.exists(model_path) else None
    spec = workload_spec(args)
    work = materialize(build_workload(spec, vocab), tokenizer)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    ids: dict[str, list[list[list[int]]]] = {"a": [], "b": []}
    configs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="deepinfer-ab-") as tmp:
        wl = Path(tmp) / "workload.json"
        wl.write_text(json.dumps({"work": work}))

        def command(label: str) -> list[str]:
            side = sides[label]
            cmd = [sys.executable, "-m", "deepinfer.bench.worker", "--model", str(model_path), "--workload", str(wl),
                   "--overrides", json.dumps(side["overrides"]), "--temperature", str(args.temperature),
                   "--seed", str(args.seed)]
            if side["config"]:
                cmd += ["--config", side["config"]]
            if concurrency is not None:
                cmd += ["--concurrency", str(concurrency)]
            return cmd

        workers: dict[str, _Worker] = {}

        def worker(label: str) -> _Worker:
            if args.fresh_process and label in workers:
                workers.pop(label).close()
            if label not in workers:
                workers[label] = _Worker(label.upper(), command(label), Path(tmp) / f"{label}.log")
            return workers[label]

        order = ["a", "b"] * (args.warmup + args.repeats)
        try:
            with tqdm(total=len(order), desc="ab", unit="run", disable=args.no_progress) as bar:
                for i, label in enumerate(order):
                    reply = worker(label).run()
                    if i >= 2 * args.warmup:
                        results[label].append(reply["run"])
                        ids[label].append(reply["output_token_ids"])
                        configs[label] = reply["config"]
                    bar.update(1)
        finally:
            for w in workers.values():
                w.close()
    seed = DEFAULT_SEED if args.bootstrap_seed is None else args.bootstrap_seed
    metrics = [compare(name, [_value(r, name, sub) for r in results["a"]],
                       [_value(r, name, sub) for r in results["b"]], higher_is_better=hib, unit=unit,
                       resamples=DEFAULT_RESAMPLES, seed=seed)
               for name, sub, unit, hib in METRICS]
    identity = token_identity(ids["a"], ids["b"])
    report = {
        "schema": AB_SCHEMA,
        "created": started,
        "arguments": arguments(args),
        "environment": environment(),
        "model": str(model_path),
        "workload": describe(spec, work),
        "concurrency": concurrency,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "order": [x.upper() for x in order[2 * args.warmup:]],
        "isolation": "process per run" if args.fresh_process else "process per configuration, engine per run",
        "a": {"spec": sides["a"]["spec"], "config_file": sides["a"]["config"],
              "overrides": sides["a"]["overrides"], "config": configs.get("a")},
        "b": {"spec": sides["b"]["spec"], "config_file": sides["b"]["config"],
              "overrides": sides["b"]["overrides"], "config": configs.get("b")},
        "bootstrap": {"confidence": 0.95, "resamples": DEFAULT_RESAMPLES, "seed": seed,
                      "statistic": "median(B) / median(A)"},
        "metrics": metrics,
        "token_identical": identity["identical"],
        "token_identity": identity,
        "runs": results,
    }
    report["files"] = []
    if args.output:
        base = Path(args.output)
        if base.suffix in (".json", ".md"):
            base = base.with_suffix("")
        base.parent.mkdir(parents=True, exist_ok=True)
        report["files"] = [str(base.with_suffix(".json")), str(base.with_suffix(".md"))]
        base.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        base.with_suffix(".md").write_text(markdown(report))
    return report
