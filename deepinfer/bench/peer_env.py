"""Baselines that live in an environment of their own (llama.cpp, vLLM's CPU build): found, never installed.

A peer's interpreter runs a script of this package (``*_peer.py``, which imports nothing of deepinfer) on
the bench's token-id workload and talks through two JSON files: the spec in, and per request its start,
every token's arrival and the tokens out (``{"requests": [{"start", "times", "tokens"}, ...], "start", "end",
...}``, seconds of ``time.perf_counter``). This module finds the interpreter, runs the script and turns its
answer into the engine's request records.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepinfer.bench.metrics import RequestRecord

Work = list[tuple[list[int], int]]


def peer_python(given: str | None, *, env_var: str, module: str, baseline: str, package: str) -> str:
    """The interpreter whose environment imports ``module``: ``given``, else ``$env_var``; a clear error when
    neither names one that imports it."""
    python = given or os.environ.get(env_var)
    if not python:
        raise ValueError(f"--baseline {baseline} needs the interpreter of an environment with {package}: "
                         f"--baseline-python PATH or ${env_var} (the project never installs peers)")
    found = shutil.which(python) or python
    check = subprocess.run([found, "-c", f"import {module}"], capture_output=True, text=True)
    if check.returncode != 0:
        raise ValueError(f"--baseline-python {python!r} cannot import {module}: {check.stderr.strip()[-300:]}")
    return found


def run_peer_script(python: str, script: Path, spec: dict[str, Any], *, baseline: str,
                    failure: Callable[[str], str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``script`` in ``python``'s environment on ``spec``; its answer (``RuntimeError`` naming the peer's
    own error, as ``failure`` picks it from stderr, if it fails)."""
    with tempfile.TemporaryDirectory() as tmp:
        source, destination = Path(tmp) / "in.json", Path(tmp) / "out.json"
        source.write_text(json.dumps(spec))
        # Run as -c source, not by path: the script's folder (deepinfer/bench, with its http.py) must not lead
        # the peer's sys.path.
        done = subprocess.run([python, "-c", script.read_text(), str(source), str(destination)],
                              capture_output=True, text=True, cwd=tmp, env={**os.environ, **(env or {})})
        if done.returncode != 0:
            how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
            raise RuntimeError(f"the {baseline} baseline failed ({how}): {failure(done.stderr)}")
        return json.loads(destination.read_text())


def peer_records(work: Work, result: dict[str, Any]) -> tuple[list[RequestRecord], list[list[int]]]:
    """A peer's answer as the engine's request records (one token per arrival), and the output ids."""
    records = [RequestRecord(prompt_len=len(prompt), start=r["start"], chunk_times=r["times"],
                             chunk_tokens=[1] * len(r["tokens"]), output_token_ids=r["tokens"])
               for (prompt, _), r in zip(work, result["requests"], strict=True)]
    return records, [r["tokens"] for r in result["requests"]]


def traceback_or_tail(stderr: str, noise: tuple[str, ...] = ()) -> str:
    """What a peer's stderr says went wrong: its Python traceback when there is one (without lines starting
    with ``noise``, the peer's own log lines that interleave with it), else the last 1,000 characters."""
    start = stderr.rfind("Traceback (most recent call last)")
    if start >= 0:
        lines = [line for line in stderr[start:].splitlines() if not line.startswith(noise)]
        return "\n".join(lines)[-2000:]
    return stderr.strip()[-1000:]
