"""Read-ahead of queued requests' disk blocks on and off (issue 34), SmolLM2 on the CPU with a disk-only tier.

    python scripts/bench_kv_read_ahead.py [--prefixes 4] [--prefix-blocks 8] [--repeats 5] [--output out.json]

A first engine computes ``--prefixes`` prompts of ``--prefix-blocks`` blocks of 128 tokens and is shut down
with its blocks saved by the ``disk`` store. Then per repeat and arm a fresh engine on the same folder (its
device cache empty) gets, in one ``generate`` call, ``--decoders`` requests of 64 prompt tokens and
``--decode-tokens`` new tokens, then one request per prefix (the prefix plus a 32-token tail, 16 new tokens), with
``scheduler.max_num_seqs`` = ``--decoders``: the prefix requests wait in the queue until decoders finish.
Arm ``on`` is the engine as shipped (``KVCacheManager.prefetch`` reads a queued request's disk blocks on the
tiers' reader thread); arm ``off`` replaces that method with one that does nothing, so the admission reads
and checksums the files on the scheduling thread. The arms alternate, the first arm rotating per repeat.
Reported per arm: the median over repeats of the call's wall time, of the prefix requests' median TTFT
(``first_token_time - arrival_time``) and of the seconds the scheduling thread spent in promotions' loads
(``KVTiers.load``, timed by a wrapper). The block files sit in the page cache after the first engine wrote
them, so "disk" here is a read from memory plus a BLAKE2b checksum per 5.9 MB block, the least a disk tier
costs; the tokens of both arms are checked to be equal.
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
from bench_kv_tiers import clear_device

from deepinfer import LLM, SamplingParams
from deepinfer.model.assets import resolve_model_path

BLOCK = 128


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model: Path, folder: str, args: argparse.Namespace) -> LLM:
    return LLM(str(model), block_size=BLOCK, kv_cache_bytes=args.device_mb << 20, max_model_len=4096,
               max_num_seqs=args.decoders, cache={"kv_store": "disk"},
               plugins={"cpu": {"enabled": True}, "kv_store": {"enabled": True, "disk_dir": folder}})


def _time_promotions(llm: LLM) -> list[float]:
    """Seconds of every promotion's loads on the scheduling thread (``KVTiers.load``), appended as they run."""
    tiers, seconds = llm.engine.kv_tiers, []
    load = tiers.load

    def timed(*a: Any, **k: Any) -> int:
        start = time.perf_counter()
        try:
            return load(*a, **k)
        finally:
            seconds.append(time.perf_counter() - start)

    tiers.load = timed
    return seconds


def run(model: Path, args: argparse.Namespace, folder: str) -> dict[str, Any]:
    prefixes = [_tokens(args.prefix_blocks * BLOCK, 1 + i) for i in range(args.prefixes)]
    first = _engine(model, folder, args)
    first.generate([p + _tokens(8, 100 + i) for i, p in enumerate(prefixes)],
                   SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    clear_device(first)  # every cached block evicted, so demoted to the disk
    first.shutdown()
    decode = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    hit = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [_tokens(64, 200 + i) for i in range(args.decoders)] + \
        [p + _tokens(32, 300 + i) for i, p in enumerate(prefixes)]
    params = [decode] * args.decoders + [hit] * args.prefixes
    results: dict[str, dict[str, list[float]]] = {arm: {"wall_s": [], "ttft_ms": [], "promotion_ms": []}
                                                    for arm in ("on", "off")}
    tokens: dict[str, list[list[int]]] = {}
    promoted: dict[str, int] = {}
    for repeat in range(args.repeats):
        for arm in (("on", "off") if repeat % 2 == 0 else ("off", "on")):
            llm = _engine(model, folder, args)
            if arm == "off":
                llm.engine.kv.prefetch = lambda *a, **k: None
            loading = _time_promotions(llm)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[arm]["wall_s"].append(time.perf_counter() - start)
            results[arm]["promotion_ms"].append(1000 * sum(loading))
            hits = outs[args.decoders:]
            results[arm]["ttft_ms"].append(1000 * statistics.median(
                o.metrics.first_token_time - o.metrics.arrival_time for o in hits))
            tokens[arm] = [o.outputs[0].token_ids for o in outs]
            promoted[arm] = llm.get_stats()["kv_tiers"]["promoted_blocks"]
            llm.shutdown()
    summary = {arm: {"wall_s_median": statistics.median(r["wall_s"]),
                     "hit_ttft_ms_median": statistics.median(r["ttft_ms"]),
                     "promotion_ms_median": statistics.median(r["promotion_ms"]), **r,
                     "promoted_blocks": promoted[arm]}
               for arm, r in results.items()}
    return {"arms": summary, "tokens_equal": tokens["on"] == tokens["off"],
            "wall_on_over_off": summary["on"]["wall_s_median"] / summary["off"]["wall_s_median"],
            "ttft_on_over_off": summary["on"]["hit_ttft_ms_median"] / summary["off"]["hit_ttft_ms_median"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--prefix-blocks", type=int, default=8)
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--device-mb", type=int, default=512, help="device KV cache (default 512 MiB: 86 blocks)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        result = {"args": vars(args), **run(resolve_model_path("smollm2-135m-instruct"), args, folder)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
