"""Running a workload through the engine: offline throughput and a concurrency sweep.

Offline mode queues every request at once (``concurrency: null``); concurrency ``C`` keeps at most C
requests in flight, admitting the next one as soon as one finishes (a closed loop, like
``--max-concurrency`` of the peers' serving benchmarks). The engine streams (``stream``), so every
step reports each request that got tokens and the runner stamps each chunk's arrival. Only the
``Engine`` protocol (``entrypoints.llm``) is used, so one process and expert-parallel ranks
(``parallel.expert_parallel_size``) run alike; the run's counters are differences of ``get_stats()``
(summed over the ranks).

Each run gets a fresh engine (so the prefix cache holds nothing from an earlier run), warmed up with a
few short requests that share no prefix with the workload; the warm-up is not measured.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
from tqdm.auto import tqdm

from deepinfer.bench.metrics import RequestRecord, compute_metrics, latency_samples, output_digest, step_split
from deepinfer.bench.workloads import warmup_workload

Work = list[tuple[list[int], int]]
_CORE_STATS = frozenset({"steps", "prompt_tokens", "generated_tokens", "prefix_cache_hit_rate", "preemptions",
                         "kv_blocks_total", "kv_blocks_free", "step_time_split", "prefix_cache_hit_tokens",
                         "prefix_cache_lookup_tokens"})


def sections(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A nested override tree as ``LLM(**sections)`` keywords."""
    return {("model_config" if k == "model" else k): v for k, v in tree.items()}


def build_llm(model: str, config: Any = None, overrides: Mapping[str, Any] | None = None) -> Any:
    from deepinfer import LLM

    return LLM(model, config=config, **sections(overrides or {}))


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepinfer")
    except PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Where a run happened (the ``environment`` object of the reports)."""
    import torch

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "deepinfer": _version(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def _params(max_tokens: int, temperature: float, seed: int | None) -> Any:
    from deepinfer import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                          seed=seed if temperature > 0 else None)


def run_engine(llm: Any, work: Work, *, concurrency: int | None = None, temperature: float = 0.0,
               seed: int = 0, progress: bool = True, desc: str = "bench") -> tuple[dict[str, Any], list[list[int]]]:
    """Run ``work`` on ``llm``; returns the run object (``docs/bench.md``) and every request's output ids.

    EOS is ignored so every request produces exactly its ``output_len`` tokens; request ``i`` samples
    with seed ``seed + i`` when ``temperature > 0``.
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError("--concurrency values must be at least 1")
    engine = llm.engine
    requests = [engine.make_request(ids, _params(m, temperature, seed + i)) for i, (ids, m) in enumerate(work)]
    records = {r.request_id: RequestRecord(prompt_len=r.num_prompt_tokens, start=0.0) for r in requests}
    order = [r.request_id for r in requests]
    before = engine.get_stats()
    limit = len(requests) if concurrency is None else concurrency
    pending = list(reversed(requests))
    in_flight: set[str] = set()
    errors = 0
    old_stream = engine.stream
    engine.stream = True
    try:
        with tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, leave=False) as bar:
            t0 = time.perf_counter()
            while pending or in_flight:
                while pending and len(in_flight) < limit:
                    req = pending.pop()
                    records[req.request_id].start = time.perf_counter()
                    engine.add(req)
                    in_flight.add(req.request_id)
                outs = engine.step()
                now = time.perf_counter()
                for out in outs:
                    rec = records.get(out.request_id)
                    if rec is None or out.request_id not in in_flight:
                        continue
                    ids = out.outputs[0].token_ids
                    new = len(ids) - len(rec.output_token_ids)
                    if new > 0:
                        rec.chunk_times.append(now)
                        rec.chunk_tokens.append(new)
                        rec.output_token_ids = list(ids)
                    if out.finished:
                        in_flight.discard(out.request_id)
                        errors += out.outputs[0].finish_reason in ("error", "abort")
                        bar.update(1)
            end = time.perf_counter()
    finally:
        engine.stream = old_stream
    after = engine.get_stats()
    recs = [records[i] for i in order]
    hits, lookups = (after[k] - before[k] for k in ("prefix_cache_hit_tokens", "prefix_cache_lookup_tokens"))
    run: dict[str, Any] = {
        "engine": "deepinfer",
        "mode": "offline" if concurrency is None else "concurrency",
        "concurrency": concurrency,
        **compute_metrics(recs, end - t0),
        "failed_requests": errors,
        "steps": after["steps"] - before["steps"],
        "preemptions": after["preemptions"] - before["preemptions"],
        "prefix_cache_hit_rate": hits / lookups if lookups else 0.0,
        "step_time_split": step_split(before["step_time_split"], after["step_time_split"]),
        "plugin_stats": {k: v for k, v in after.items() if k not in _CORE_STATS},
        "output_digest": output_digest([r.output_token_ids for r in recs]),
        "samples": latency_samples(recs),
    }
    run["samples"].pop("itl_ms")  # pooled gaps can be millions of numbers; their summary is in itl_ms
    run["_records"] = recs
    return run, [r.output_token_ids for r in recs]


def measure(model: str, work: Work, *, config: Any = None, overrides: Mapping[str, Any] | None = None,
            concurrency: int | None = None, temperature: float = 0.0, seed: int = 0, progress: bool = True,
            desc: str = "bench", llm: Any = None) -> tuple[dict[str, Any], list[list[int]], dict[str, Any]]:
    """One measured run on a fresh engine (or on ``llm`` if given, which must be fresh): warm-up, run,
    shut down. Returns (run, output ids, effective config)."""
    llm = llm if llm is not None else build_llm(model, config, overrides)
    try:
        vocab = llm.engine.intake.vocab_size
        run_engine(llm, warmup_workload(vocab), progress=False)
        run, ids = run_engine(llm, work, concurrency=concurrency, temperature=temperature, seed=seed,
                              progress=progress, desc=desc)
        cfg = llm.engine.config.model_dump(mode="json")
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next engine sizes its KV cache from the device's free memory
    return run, ids, cfg


def public(run: Mapping[str, Any]) -> dict[str, Any]:
    """A run without its in-memory fields (the ones starting with ``_``)."""
    return {k: v for k, v in run.items() if not k.startswith("_")}
