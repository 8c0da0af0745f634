"""Time to first token for a long shared prefix that the device prefix cache has lost: promoted back from a
KV tier (``cache.kv_store``: ``host``, ``disk``) against recomputing it (issue 34).

    python scripts/bench_kv_tiers.py [--prefix 1024] [--tail 64] [--repeats 5] [--threads 2]
        [--disk-dir /tmp/kv] [--output out.json]

SmolLM2-135M-Instruct (the project's real model), float32 on the CPU, blocks of 128 tokens. One engine per
arm, all in this process: ``recompute`` (prefix caching on, no store), ``host``, ``disk``, and ``device``
(the prefix still on the device: the ceiling). Each engine first computes the shared prefix once (a
request of prefix + a tail). Then, per repeat, in turn for each arm: the device cache is cleared by
allocating and releasing every free block — the path a real allocation takes, so the tier arms demote
the evicted blocks — except in the ``device`` arm; the writer queue is flushed (untimed); then one
request, prefix + a fresh random tail, one output token, is timed from ``generate`` to its return (its
TTFT: the prefill, plus the promotion in the tier arms). Medians over ``--repeats``; the first token of
every arm is checked to be the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.assets import resolve_model_path

ARMS = ("recompute", "host", "disk", "device")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model: Path, arm: str, disk_dir: str) -> LLM:
    store = {"host": "host", "disk": "disk"}.get(arm)
    return LLM(str(model), kv_cache_bytes=256 << 20, max_model_len=4096, block_size=128,
               cache={"kv_store": store},
               plugins={"kv_store": {"enabled": True, "host_bytes": 1 << 30, "disk_dir": disk_dir}})


def clear_device(llm: LLM) -> None:
    """Evict every cached block (demoting it when the engine has tiers), as an allocation would."""
    pool = llm.engine.kv.pool
    ids = pool.allocate(pool.num_free) or []
    pool.free(ids)
    if llm.engine.kv_tiers is not None:
        llm.engine.kv_tiers.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--tail", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--disk-dir", default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model_path("smollm2-135m-instruct")
    disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="deepinfer-kv-bench-")
    prefix = _tokens(args.prefix, 0)
    one = SamplingParams(temperature=0, max_tokens=1)
    engines = {arm: _engine(model, arm, disk_dir) for arm in ARMS}
    for llm in engines.values():  # the prefix, computed once by every engine (also a warm-up)
        llm.generate([prefix + _tokens(args.tail, 1)], one, use_tqdm=False)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    firsts: dict[str, list[int]] = {arm: [] for arm in ARMS}
    computed: dict[str, list[int]] = {arm: [] for arm in ARMS}
    for r in range(args.repeats):
        prompt = prefix + _tokens(args.tail, 100 + r)
        for arm, llm in engines.items():
            if arm != "device":
                clear_device(llm)
            hits = llm.get_stats()["prefix_cache_hit_tokens"]
            start = time.perf_counter()
            out = llm.generate([prompt], one, use_tqdm=False)
            times[arm].append(time.perf_counter() - start)
            firsts[arm].append(out[0].outputs[0].token_ids[0])
            computed[arm].append(len(prompt) - (llm.get_stats()["prefix_cache_hit_tokens"] - hits))
    assert all(firsts[arm] == firsts["recompute"] for arm in ARMS), firsts
    result: dict[str, Any] = {
        "model": "smollm2-135m-instruct", "dtype": "float32", "block_size": 128, "prefix": args.prefix,
        "tail": args.tail, "repeats": args.repeats, "threads": args.threads,
        "ttft_median_ms": {arm: 1000 * statistics.median(times[arm]) for arm in ARMS},
        "ttft_ms": {arm: [1000 * t for t in times[arm]] for arm in ARMS},
        "computed_tokens": computed, "first_tokens_equal": True,
        "tiers": {arm: engines[arm].get_stats().get("kv_tiers") for arm in ("host", "disk")},
    }
    base = result["ttft_median_ms"]["recompute"]
    result["speedup_vs_recompute"] = {arm: base / result["ttft_median_ms"][arm] for arm in ARMS}
    for llm in engines.values():
        llm.shutdown()
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
