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

from pathlib import Path
from typing import Any

from deepinfer.bench.baseline import peer_run
from deepinfer.bench.peer_env import Work, peer_records, run_peer_script, traceback_or_tail
from deepinfer.bench.peer_env import peer_python as find_python

PEER_SCRIPT = Path(__file__).with_name("llama_cpp_peer.py")
PYTHON_ENV = "DEEPINFER_LLAMA_CPP_PYTHON"


def peer_python(given: str | None) -> str:
    """The interpreter that has ``llama_cpp``: ``given``, else ``$DEEPINFER_LLAMA_CPP_PYTHON``; a clear error
    when neither names one that imports it."""
    return find_python(given, env_var=PYTHON_ENV, module="llama_cpp", baseline="llama.cpp", package="llama-cpp-python")


DTYPES = ("q4_1", "float32", "bfloat16")


def run_llama_cpp(python: str, gguf: Path, work: Work, *, threads: int, n_ctx: int, dtype: str, slots: int,
                  offline: bool) -> tuple[dict[str, Any], list[list[int]]]:
    """Run ``work`` through llama.cpp in ``python``'s environment, ``slots`` sequences at a time; returns
    (run, output ids)."""
    if dtype not in DTYPES:
        raise ValueError(f"--baseline-dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if slots < 1:
        raise ValueError(f"the llama.cpp baseline needs at least one slot, got {slots}")
    spec = {"gguf": str(gguf), "work": work, "threads": threads, "n_ctx": n_ctx, "dtype": dtype, "slots": slots,
            "offline": offline}
    result = run_peer_script(python, PEER_SCRIPT, spec, baseline="llama.cpp",
                             failure=lambda stderr: traceback_or_tail(stderr, _LLAMA_LOG))
    records, outputs = peer_records(work, result)
    run = peer_run(f"llama.cpp {result['version']}", records, outputs, result["end"] - result["start"],
                   offline=offline, batch_size=slots, gguf=result["gguf"], baseline_dtype=dtype)
    return run, outputs


_LLAMA_LOG = ("llama_", "llm_", "load", "print_info", "sched_", "graph")  # llama.cpp's log line prefixes
