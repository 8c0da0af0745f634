"""The process that runs one A/B configuration: ``python -m deepinfer.bench.worker``.

It reads commands from stdin, one a line: ``run`` builds a fresh engine from its configuration, warms
it up, runs the workload and prints one result line (``@@deepinfer-ab `` then JSON: the run object,
every request's output ids and the effective config); ``exit`` (or end of input) stops it. Anything
else it prints (progress, logs) goes to stderr; an error is reported as ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any

MARKER = "@@deepinfer-ab "


def _reply(payload: dict[str, Any]) -> None:
    sys.stdout.write(MARKER + json.dumps(payload) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepinfer.bench.worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True, help="JSON file: {\"work\": [[prompt ids, output len], ...]}")
    ap.add_argument("--config", default=None)
    ap.add_argument("--overrides", default="{}", help="nested override tree as JSON")
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from deepinfer.bench.runner import measure, public

    with open(args.workload) as f:
        work = [(list(p), int(m)) for p, m in json.load(f)["work"]]
    overrides = json.loads(args.overrides)
    for line in sys.stdin:
        command = line.strip()
        if command == "exit":
            break
        if command != "run":
            _reply({"error": f"unknown command {command!r}"})
            continue
        try:
            run, ids, config = measure(args.model, work, config=args.config, overrides=overrides,
                                       concurrency=args.concurrency, temperature=args.temperature,
                                       seed=args.seed, progress=False)
        except Exception as exc:  # reported to the parent, which stops the A/B run
            traceback.print_exc(file=sys.stderr)
            _reply({"error": f"{type(exc).__name__}: {exc}"})
            return 1
        run = public(run)
        run.pop("samples", None)
        _reply({"run": run, "output_token_ids": ids, "config": config})
    return 0


if __name__ == "__main__":
    sys.exit(main())
