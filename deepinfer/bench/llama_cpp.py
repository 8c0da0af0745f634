"""The llama.cpp baseline (``deepinfer bench --baseline llama.cpp``), found, never installed.

The peer is ``llama-cpp-python`` in an environment of its own: ``--baseline-python`` (or
``$DEEPINFER_LLAMA_CPP_PYTHON``) names that environment's interpreter, which runs
``llama_cpp_peer.py`` on the same token-id workload. Its GGUF is the model alias's own file
(``assets.fetch_gguf``: SmolLM2's Q4_1, the file deepinfer converts from) or ``--baseline-gguf``;
``--baseline-dtype float32`` / ``bfloat16`` runs it dequantized to that dtype (the weights deepinfer's
float32 / bf16 run holds), ``q4_1`` (default) as shipped. Requests run as ``llama-server`` runs them: ``slots``
sequences continuously batched in one context (the concurrency, or ``--baseline-batch`` offline), greedy, EOS
ignored; every token's arrival is stamped, so the metrics are the engine's (TTFT, TPOT, ITL, throughput). In
offline mode every request starts at the run's start, as for the engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from deepinfer.bench.baseline import peer_run
from deepinfer.bench.metrics import RequestRecord

Work = list[tuple[list[int], int]]
PEER_SCRIPT = Path(__file__).with_name("llama_cpp_peer.py")
PYTHON_ENV = "DEEPINFER_LLAMA_CPP_PYTHON"


def peer_python(given: str | None) -> str:
    """The interpreter that has ``llama_cpp``: ``given``, else ``$DEEPINFER_LLAMA_CPP_PYTHON``; a clear error
    when neither names one that imports it."""
    python = given or os.environ.get(PYTHON_ENV)
    if not python:
        raise ValueError(f"--baseline llama.cpp needs the interpreter of an environment with llama-cpp-python: "
                         f"--baseline-python PATH or ${PYTHON_ENV} (the project never installs peers)")
    found = shutil.which(python) or python
    check = subprocess.run([found, "-c", "import llama_cpp"], capture_output=True, text=True)
    if check.returncode != 0:
        raise ValueError(f"--baseline-python {python!r} cannot import llama_cpp: {check.stderr.strip()[-300:]}")
    return found


DTYPES = ("q4_1", "float32", "bfloat16")


def run_llama_cpp(python: str, gguf: Path, work: Work, *, threads: int, n_ctx: int, dtype: str, slots: int,
                  offline: bool) -> tuple[dict[str, Any], list[list[int]]]:
    """Run ``work`` through llama.cpp in ``python``'s environment, ``slots`` sequences at a time; returns
    (run, output ids)."""
    if dtype not in DTYPES:
        raise ValueError(f"--baseline-dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if slots < 1:
        raise ValueError(f"the llama.cpp baseline needs at least one slot, got {slots}")
    with tempfile.TemporaryDirectory() as tmp:
        source, destination = Path(tmp) / "in.json", Path(tmp) / "out.json"
        source.write_text(json.dumps({"gguf": str(gguf), "work": work, "threads": threads, "n_ctx": n_ctx,
                                      "dtype": dtype, "slots": slots, "offline": offline}))
        # Run as -c source, not by path: the script's folder (deepinfer/bench, with its http.py) must not lead
        # the peer's sys.path.
        done = subprocess.run([python, "-c", PEER_SCRIPT.read_text(), str(source), str(destination)],
                              capture_output=True, text=True, cwd=tmp)
        if done.returncode != 0:
            how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
            raise RuntimeError(f"the llama.cpp baseline failed ({how}): {_failure(done.stderr)}")
        result = json.loads(destination.read_text())
    t0 = result["start"]
    records = [RequestRecord(prompt_len=len(prompt), start=r["start"], chunk_times=r["times"],
                             chunk_tokens=[1] * len(r["tokens"]), output_token_ids=r["tokens"])
               for (prompt, _), r in zip(work, result["requests"], strict=True)]
    outputs = [r["tokens"] for r in result["requests"]]
    run = peer_run(f"llama.cpp {result['version']}", records, outputs, result["end"] - t0, offline=offline,
                   batch_size=slots, gguf=result["gguf"], baseline_dtype=dtype)
    return run, outputs


_LLAMA_LOG = ("llama_", "llm_", "load", "print_info", "sched_", "graph")  # llama.cpp's log line prefixes


def _failure(stderr: str) -> str:
    """What the peer's stderr says went wrong: its Python traceback when there is one (llama.cpp's own log
    lines interleave with it, so the tail alone is often only a model-loading line), else the last 1,000
    characters."""
    start = stderr.rfind("Traceback (most recent call last)")
    if start >= 0:
        lines = [line for line in stderr[start:].splitlines() if not line.startswith(_LLAMA_LOG)]
        return "\n".join(lines)[-2000:]
    return stderr.strip()[-1000:]
