"""A multi-turn chat workload whose working set exceeds the device KV cache: TTFT p50/p90 and throughput with
no KV store, ``host``, and ``host+disk`` (issue 34): SmolLM2 on the CPU, or a dummy-weight
Llama-3-8B-shaped model (``scripts/llama3_8b_shaped.json``, bf16) on a GPU.

    python scripts/bench_kv_tiers_chat.py [--model smollm2|llama8b] [--device cpu|cuda] [--conversations 16]
        [--turns 3] [--system 512] [--user 256] [--reply 16] [--device-blocks 11] [--host-gib 2]
        [--threads 2] [--cprofile FILE] [--output out.json]

``--conversations`` conversations share a ``--system``-token system prompt; each turn appends a
``--user``-token message (random ids) to the conversation so far (system, earlier messages and the
model's replies) and asks for a ``--reply``-token answer (greedy, EOS ignored). Turns go round-robin over
the conversations, one request at a time, so each request finds the device cache as the others left it.
The device cache holds ``--device-blocks`` blocks of 128 tokens (the default, 11, holds the longest
request, about a tenth of the default workload's working set of 106 blocks: the system prompt plus every
conversation's history). One engine per arm, all three alive at once (prefix caching on in each); every
request runs in each arm in turn, the order rotating, so the shared machine's load changes hit the arms
alike. TTFT is ``first_token_time - arrival_time`` of each request; throughput the reply tokens over the
seconds the arm's ``generate`` calls took. Whether the replies of every arm are the same is reported (with
dummy bf16 weights on a GPU, a prefill of only the missing tail may round differently from a whole one).
On CUDA the engines run the ``attention`` plugin with CUDA graphs; the host store is pinned memory.
``--cprofile FILE``: a ``cProfile`` of the ``host`` arm's ``generate`` calls (the scheduling thread: promotions,
demotions, the steps' launches), its 40 costliest functions by cumulative time written to ``FILE``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.assets import resolve_model_path

LLAMA8B_CONFIG = Path(__file__).parent / "llama3_8b_shaped.json"
ARMS = {"none": None, "host": "host", "host+disk": "host+disk"}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _model_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments every engine shares: the model's weights and dtype, and where it runs."""
    if args.device == "cpu":
        return {"device": "cpu"}
    return {"device": args.device, "dtype": "bfloat16", **({"load_format": "dummy"} if args.model == "llama8b" else {})}


def _engine(model: Path, store: str | None, args: argparse.Namespace, disk_dir: str, per_block: int) -> LLM:
    plugins: dict[str, Any] = {"attention": {"enabled": True}} if args.device != "cpu" else {}
    plugins["kv_store"] = {"enabled": True, "host_bytes": int(args.host_gib * (1 << 30)), "disk_dir": disk_dir}
    return LLM(str(model), kv_cache_bytes=per_block * (args.device_blocks + 1), block_size=128,
               max_model_len=args.device_blocks * 128, cache={"kv_store": store}, plugins=plugins,
               **_model_args(args))


def run(model: Path, args: argparse.Namespace, disk_dir: str) -> dict[str, Any]:
    """Every arm's engine at once; each request runs in every arm in turn (the order rotating), so the
    shared machine's load changes hit the arms alike."""
    probe = LLM(str(model), kv_cache_bytes=1 << 30, block_size=128, max_model_len=1024, **_model_args(args))
    per_block = sum(t[0].numel() * t.element_size() for t in probe.engine.pool.paged)
    probe.shutdown()
    del probe
    engines = {arm: _engine(model, store, args, disk_dir, per_block) for arm, store in ARMS.items()}
    params = SamplingParams(temperature=0, max_tokens=args.reply, ignore_eos=True)
    system = _tokens(args.system, 0)
    history = {arm: [list(system) for _ in range(args.conversations)] for arm in ARMS}
    replies: dict[str, list[list[int]]] = {arm: [] for arm in ARMS}
    ttft: dict[str, list[float]] = {arm: [] for arm in ARMS}
    busy: dict[str, float] = dict.fromkeys(ARMS, 0.0)
    computed: dict[str, int] = dict.fromkeys(ARMS, 0)
    order = list(ARMS)
    profiler = cProfile.Profile() if args.cprofile else None
    for turn in range(args.turns):
        for c in range(args.conversations):
            message = _tokens(args.user, 1000 * c + turn + 1)
            order = order[1:] + order[:1]
            for arm in order:
                llm, prompt = engines[arm], history[arm][c]
                prompt += message
                hits = llm.get_stats()["prefix_cache_hit_tokens"]
                profiled = profiler is not None and arm == "host"
                if profiled:
                    profiler.enable()
                start = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                busy[arm] += time.perf_counter() - start
                if profiled:
                    profiler.disable()
                computed[arm] += len(prompt) - (llm.get_stats()["prefix_cache_hit_tokens"] - hits)
                ttft[arm].append(out.metrics.first_token_time - out.metrics.arrival_time)
                replies[arm].append(out.outputs[0].token_ids)
                prompt += out.outputs[0].token_ids
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        Path(args.cprofile).write_text(text.getvalue())
    results: dict[str, Any] = {}
    for arm, llm in engines.items():
        stats = llm.get_stats()
        llm.shutdown()
        results[arm] = {"ttft_p50_ms": 1000 * statistics.median(ttft[arm]),
                        "ttft_p90_ms": 1000 * _quantile(ttft[arm], 0.9),
                        "reply_tok_per_s": len(replies[arm]) * args.reply / busy[arm], "busy_s": busy[arm],
                        "computed_tokens": computed[arm], "prompt_tokens": stats["prompt_tokens"],
                        "kv_tiers": stats.get("kv_tiers"), "ttft_ms": [1000 * t for t in ttft[arm]]}
    working_set = len(system) + sum(len(h) - len(system) for h in history["none"])
    return {"arms": results, "working_set_tokens": working_set,
            "replies_equal": all(r == replies["none"] for r in replies.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "llama8b"], default="smollm2",
                        help="smollm2: SmolLM2-135M-Instruct; llama8b: the dummy Llama-3-8B shape (GPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system", type=int, default=512)
    parser.add_argument("--user", type=int, default=256)
    parser.add_argument("--reply", type=int, default=16)
    parser.add_argument("--device-blocks", type=int, default=11)
    parser.add_argument("--host-gib", type=float, default=2.0, help="the host store's capacity")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cprofile", default=None, help="write a cProfile of the host arm's generate calls here")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with (tempfile.TemporaryDirectory(prefix="deepinfer-kv-chat-") as disk_dir,
          tempfile.TemporaryDirectory(prefix="deepinfer-kv-chat-model-") as folder):
        if args.model == "llama8b":
            model = Path(folder)
            (model / "config.json").write_text(LLAMA8B_CONFIG.read_text())
        else:
            model = resolve_model_path("smollm2-135m-instruct")
        out: dict[str, Any] = {"workload": vars(args), **run(model, args, disk_dir)}
    arms = out["arms"]
    out["ttft_p50_ratio_none_over_host"] = arms["none"]["ttft_p50_ms"] / arms["host"]["ttft_p50_ms"]
    text = json.dumps(out, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
