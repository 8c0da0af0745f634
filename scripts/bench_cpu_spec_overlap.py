"""Speculative decoding under the overlapped executor against the synchronous one, on CPU (issue 28).

    python scripts/bench_cpu_spec_overlap.py [--batch 1 8 32] [--acceptance 0.7] [--drafter oracle|ngram|dspark]
        [--dspark FIELD=VALUE ...] [--repeats 3] [--new-tokens 64] [--threads 2] [--output spec_overlap.json]

SmolLM2-135M-Instruct fp32 with the ``cpu`` plugin (oneDNN GEMMs, paged attention), greedy, EOS ignored,
prefix caching off. Configurations: no speculation, ``fixed``-5 and ``varlen``, each under the ``sync``
and the ``overlap`` executor; one engine per configuration, all alive, the calls interleaved per
repeat. Workload per batch ``B``: ``B`` chat questions (a fixed list, the chat template applied).
Timed per repeat: ``t1`` (``max_tokens=1``) and ``t_full`` (``max_tokens = new_tokens + 1``); decode
tok/s = ``B · new_tokens / (t_full − t1)``, median over repeats, as ``scripts/bench_gpu_spec.py``.

``--drafter oracle`` (default): a first engine records every prompt's greedy reply, which becomes the
oracle's file; each draft is then the known next token, replaced by a wrong one with probability
``1 − a`` (``--acceptance a``). ``--drafter ngram``: prompt lookup on the model's own replies.
``--drafter dspark``: the ``dspark`` drafter, random weights unless ``--dspark dspark_weights=FILE``
(random drafts: what ``varlen`` pays for a drafter whose drafts do not pay); ``--draft-vocab N`` gives the
random drafter a draft vocabulary of the ``N`` token ids the recorded replies use most (then by id), so
its head costs what a trained drafter's does (SmolLM2's: 8,192). Outputs
must be token-identical across configurations (greedy); the engine's acceptance statistics and the
share of steps in which a speculating request followed a step in flight are reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams

TOPICS = ["the ocean", "volcanoes", "honey bees", "the moon", "bread", "chess", "rain", "libraries", "trains",
          "coffee", "mountains", "glass", "tea", "bicycles", "clocks", "rivers", "owls", "maps", "music",
          "gardens", "bridges", "snow", "paper", "lighthouses", "deserts", "salt", "wind", "castles", "ants",
          "stars", "soap", "forests"]


def _prompts(llm: LLM, batch: int) -> list[list[int]]:
    tok = llm.engine.tokenizer
    questions = [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}." for i in range(batch)]
    return [tok.encode_chat([{"role": "user", "content": q}])[1] for q in questions]


def _engine(model: str, batch: int, executor: str, spec: dict | None) -> LLM:
    plugins: dict = {"cpu": {"enabled": True}}
    if executor == "overlap":
        plugins["scheduling"] = {"enabled": True}
    if spec is not None:
        plugins["spec_decode"] = {"enabled": True, "max_draft": 5, **spec}
    return LLM(model, max_num_seqs=max(batch, 1), max_model_len=1024,
               cache={"kv_cache_bytes": 256 << 20, "prefix_caching": False},
               plugins=plugins, scheduler={"executor": executor})


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def _random_drafter(model: str, settings: dict, replies: list[list[int]], vocab: int, path: Path) -> Path:
    """Random ``dspark`` weights (the engine seed's) proposing from the ``vocab`` ids ``replies`` use most."""
    from deepinfer_spec_decode.config import SpecDecodeConfig
    from deepinfer_spec_decode.dspark import build_network, save_weights, target_layers

    from deepinfer.ops import init_dummy

    llm = _engine(model, 1, "sync", None)
    target = llm.engine.model
    config = SpecDecodeConfig(drafter="dspark", **settings)
    network = build_network(target, config, len(target_layers(config, llm.engine.hf_config["num_hidden_layers"])),
                            draft_vocab_size=vocab)
    init_dummy(network, seed=0)
    counts = torch.bincount(torch.tensor([t for r in replies for t in r]), minlength=target.vocab_size).double()
    ranked = torch.argsort(-(counts - torch.arange(target.vocab_size) / target.vocab_size), stable=True)
    network.set_draft_vocab(ranked[:vocab].sort().values)
    save_weights(network, path)
    llm.shutdown()
    return path


def _follow_counter(llm: LLM) -> list[int]:
    """[decode rows, rows that followed a step in flight], counted by a spy on the core's schedule."""
    counts = [0, 0]
    core = llm.engine.core
    schedule = core.schedule

    def spy():
        scheduled = schedule()
        for s in scheduled.batch.scheduled:
            if s.samples and s.request.num_output_tokens > 1:
                counts[0] += 1
                counts[1] += int(s.follows)
        return scheduled

    core.schedule = spy
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--drafter", choices=["oracle", "ngram", "dspark"], default="oracle")
    ap.add_argument("--dspark", action="append", default=[], metavar="FIELD=VALUE",
                    help="a dspark setting (--drafter dspark), e.g. dspark_num_layers=2; dspark_weights is random "
                         "unless given")
    ap.add_argument("--draft-vocab", type=int, help="random dspark weights with a draft vocabulary of this size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the VM has 2 cores)")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results: dict = {"args": vars(args) | {"output": str(args.output)}, "batches": {}}
    oracle = Path(tempfile.mkdtemp()) / "oracle.jsonl"
    for batch in args.batch:
        recorder = _engine(args.model, batch, "sync", None)
        prompts = _prompts(recorder, batch)
        _, replies = _generate(recorder, prompts, args.new_tokens + 1)
        recorder.shutdown()
        del recorder
        oracle.write_text("\n".join(json.dumps({"token_ids": p + r}) for p, r in zip(prompts, replies, strict=True)))
        if args.drafter == "oracle":
            drafter = {"drafter": "oracle", "oracle_file": str(oracle), "oracle_corruption": 1.0 - args.acceptance}
        elif args.drafter == "dspark":
            settings = {k: int(v) if v.isdigit() else v for k, v in (item.split("=", 1) for item in args.dspark)}
            drafter = {"drafter": "dspark", "dspark_weights": "random", **settings}
            if args.draft_vocab and drafter["dspark_weights"] == "random":
                drafter["dspark_weights"] = str(_random_drafter(args.model, settings, replies, args.draft_vocab,
                                                                oracle.with_name("dspark.safetensors")))
        else:
            drafter = {"drafter": "ngram"}
        configs = {f"{name}-{executor}": (executor, spec) for name, spec in
                   (("off", None), ("fixed", {**drafter, "plan": "fixed"}), ("varlen", {**drafter, "plan": "varlen"}))
                   for executor in ("sync", "overlap")}
        engines = {name: _engine(args.model, batch, executor, spec) for name, (executor, spec) in configs.items()}
        counters = {name: _follow_counter(llm) for name, llm in engines.items()}
        for llm in engines.values():  # untimed: warms every engine (and profiles varlen's curve)
            _generate(llm, prompts, args.new_tokens + 1)
        before = {name: llm.get_stats() for name, llm in engines.items()}
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                t1, _ = _generate(llm, prompts, 1)
                full, outs = _generate(llm, prompts, args.new_tokens + 1)
                assert outs == replies, f"{name}: outputs differ from decoding without speculation"
                times[name].append(batch * args.new_tokens / (full - t1))
        row = {}
        for name, llm in engines.items():
            stats = llm.get_stats()
            spec = stats.get("spec_decode") or {}
            decode, follows = counters[name]
            row[name] = {"decode_tok_s": times[name], "decode_tok_s_median": statistics.median(times[name]),
                         "mean_acceptance_length": spec.get("mean_acceptance_length"),
                         "verify_steps": spec.get("verify_steps", 0) - (before[name].get("spec_decode") or {}).get(
                             "verify_steps", 0),
                         "follow_up_share": follows / decode if decode else 0.0,
                         "step_cost_error": (stats.get("step_cost") or {}).get("prediction_error")}
            llm.shutdown()
        engines.clear()
        gc.collect()  # six engines per batch: the next batch's must not share the memory with them
        base = row["off-sync"]["decode_tok_s_median"]
        for name, r in row.items():
            r["x_off_sync"] = r["decode_tok_s_median"] / base
            print(f"batch {batch:3d} {name:15s} {r['decode_tok_s_median']:8.1f} tok/s  {r['x_off_sync']:.2f}x  "
                  f"accept {r['mean_acceptance_length']}  follow-ups {r['follow_up_share']:.2f}", flush=True)
        results["batches"][str(batch)] = row
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
