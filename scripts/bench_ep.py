"""Expert parallelism + DP attention + EPLB measurements (issues 9 and 13; results go to docs/benchmarks.md).

Three parts, each optional:

``--part decode``: decode throughput of ``LLM(model, expert_parallel_size=N)`` on a dummy-weight
DeepSeek model (``--shape v2lite``: DeepSeek-V2-Lite's shape with 64 routed experts, top-6;
``--shape small``: 8 layers of width 1024 with 64 experts; ``--shape tiny``: CPU-sized). For each
``--batches`` value B, N·B requests of ``--input-len`` tokens each generate ``--output-len`` tokens
(greedy, EOS ignored, B running per rank); reported: output tok/s per rank (per GPU), step time, and
dispatch / combine seconds per MoE layer call (host wall time around the all-to-alls); with
``--repeats R`` each batch runs R times and the medians are reported (with every step time). On CPU
every process (the ranks, and the caller itself for ``--ranks 1``) runs one torch thread.

``--part eplb``: a model whose router is biased by a Zipf law over its 64 experts (the
``e_score_correction_bias`` of a saved random checkpoint), run with each placement policy: measured
balancedness (mean over max rank load of the rows each rank received) and step time before and after
one rebalance, and the time of that rebalance (policy + weight moves).

``--part simulate``: the policies alone on Zipf traces at 8, 32 and 64 simulated ranks (no processes):
predicted balancedness before/after and policy time.

Examples::

    # CPU, 2 gloo ranks (one torch thread each)
    python scripts/bench_ep.py --device cpu --ranks 2 --shape tiny --batches 4,16 --output ep_cpu.json
    # CPU decode step time, median of 3 (docs/benchmarks.md, issue 9)
    python scripts/bench_ep.py --device cpu --ranks 4 --shape small --part decode --batches 1,8 \
        --input-len 16 --output-len 32 --repeats 3 --output ep_cpu_4.json
    # the same with the fixed-capacity dispatch (issue 30 item 2; --capacity-factor 1.25 for a smaller one)
    python scripts/bench_ep.py --device cpu --ranks 2 --shape small --part decode --batches 1,8 \
        --dispatch torch_all_to_all_capacity --output ep_cpu_capacity.json
    # every GPU of the machine, NCCL (keep NVLink multicast off)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python scripts/bench_ep.py --device cuda --ranks 8 --shape v2lite --batches 16,64,256 --output ep_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer import LLM, SamplingParams

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16,
             "qk_nope_head_dim": 32, "v_head_dim": 32, "vocab_size": 1024, "n_routed_experts": 64,
             "num_experts_per_tok": 6, "n_shared_experts": 2},
    "small": {"hidden_size": 1024, "intermediate_size": 4096, "moe_intermediate_size": 704, "num_hidden_layers": 8,
              "num_attention_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
              "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 32000, "n_routed_experts": 64,
              "num_experts_per_tok": 6, "n_shared_experts": 2},
    # DeepSeek-V2-Lite (15.7B): 27 layers, 64 routed experts of width 1408, top-6, 2 shared experts.
    "v2lite": {"hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
               "num_hidden_layers": 27, "num_attention_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 102400,
               "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2},
}
COMMON = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "first_k_dense_replace": 1,
          "n_group": 1, "topk_group": 1, "num_key_value_heads": None, "max_position_embeddings": 4096,
          "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
          "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
          "num_nextn_predict_layers": 0}


def write_dummy_config(folder: Path, shape: str) -> Path:
    """A config.json only: ``load_format="dummy"`` fills random weights from the engine seed."""
    cfg = {**COMMON, **SHAPES[shape]}
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def write_zipf_checkpoint(folder: Path, shape: str, exponent: float, seed: int = 0) -> Path:
    """A saved random checkpoint whose router prefers experts by a Zipf law: the correction bias of
    expert e (in a random order per layer) is ``scale · (1/rank)^exponent``, added for the choice."""
    import transformers

    cfg = {**COMMON, **SHAPES[shape]}
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg.pop("architectures"), cfg.pop("model_type")
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    experts = cfg["n_routed_experts"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen) if p.dim() == 1 and "norm" in name
                    else 0.05 * torch.randn(p.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                zipf = 1.0 / torch.arange(1, experts + 1).double() ** exponent
                buf.copy_((zipf / zipf[0])[torch.randperm(experts, generator=gen)].float())
    model.save_pretrained(folder)
    return folder


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=gen).tolist()


def timed_generate(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    before = llm.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    par0, par1 = before.get("parallel", {}), after.get("parallel", {})
    world = par1.get("world_size", 1)
    out = {"seconds": seconds, "output_tokens": tokens, "output_tok_s_per_rank": tokens / seconds / world,
           "step_seconds": seconds / max(1, (after["steps"] - before["steps"]) / world)}
    if "dispatch_calls" in par1:  # per rank and MoE layer call: summed seconds over summed calls
        calls = max(par1["dispatch_calls"] - par0.get("dispatch_calls", 0), 1)
        out["dispatch_s_per_layer"] = (par1["dispatch_seconds"] - par0.get("dispatch_seconds", 0.0)) / calls
        out["combine_s_per_layer"] = (par1["combine_seconds"] - par0.get("combine_seconds", 0.0)) / calls
    return out


def part_decode(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    folder = write_dummy_config(work / f"dummy-{args.shape}", args.shape)
    vocab = SHAPES[args.shape]["vocab_size"]
    rows = []
    batches = [int(b) for b in args.batches.split(",")]
    kw = {"device": args.device, "load_format": "dummy", "max_num_seqs": max(batches),
          "max_num_batched_tokens": max(4096, args.input_len * max(batches)), "block_size": 64,
          "max_model_len": args.input_len + args.output_len + 8}
    if args.device == "cpu":
        kw["kv_cache_bytes"] = 1 << 30
    kw["kernels"] = {"dispatch": args.dispatch}
    kw["parallel"] = {"dispatch_capacity_factor": args.capacity_factor}
    with LLM(folder, expert_parallel_size=args.ranks, **kw) as llm:
        timed_generate(llm, prompts_for(args.ranks, 8, vocab, 0), 4)  # warm-up
        for b in batches:
            runs = [timed_generate(llm, prompts_for(b * args.ranks, args.input_len, vocab, b), args.output_len)
                    for _ in range(args.repeats)]
            median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            rows.append({"batch_per_rank": b, "repeats": args.repeats, **median,
                         "step_seconds_each": [run["step_seconds"] for run in runs]})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def part_eplb(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    folder = write_zipf_checkpoint(work / f"zipf-{args.eplb_shape}", args.eplb_shape, args.zipf)
    vocab = SHAPES[args.eplb_shape]["vocab_size"]
    rows = []
    batch = int(args.batches.split(",")[0])
    for policy in ("greedy_multistep", "deepseek"):
        eplb = {"enabled": True, "policy": policy, "interval": 0, "window": args.window,
                "num_redundant_experts": args.ranks}
        kw = {"device": args.device, "max_num_seqs": batch, "block_size": 64,
              "max_model_len": args.input_len + args.output_len + 8}
        if args.device == "cpu":
            kw["kv_cache_bytes"] = 1 << 29
        with LLM(folder, expert_parallel_size=args.ranks, plugins={"eplb": eplb}, **kw) as llm:
            prompts = prompts_for(batch * args.ranks, args.input_len, vocab, 1)
            before = timed_generate(llm, prompts, args.output_len)
            bal_before = llm.get_stats()["eplb"]["balancedness"]
            t0 = time.perf_counter()
            llm.engine.rebalance()
            rebalance_s = time.perf_counter() - t0
            after = timed_generate(llm, prompts, args.output_len)
            stats = llm.get_stats()["eplb"]
            rows.append({"policy": policy, "ranks": args.ranks, "balancedness_before": bal_before,
                         "balancedness_after": stats["balancedness"],
                         "predicted_before": stats.get("last_predicted_balancedness_before"),
                         "predicted_after": stats.get("last_predicted_balancedness_after"),
                         "step_seconds_before": before["step_seconds"], "step_seconds_after": after["step_seconds"],
                         "rebalance_seconds": rebalance_s, "policy_seconds": stats["policy_seconds"],
                         "shuffle_seconds": stats["shuffle_seconds"], "experts_sent": stats["experts_sent"],
                         "bytes_sent": stats["bytes_sent"]})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def part_simulate(args: argparse.Namespace) -> list[dict[str, Any]]:
    from deepinfer_eplb.config import EPLBConfig
    from deepinfer_eplb.plugin import Plugin

    from deepinfer.interfaces import Topology
    from deepinfer.parallel.placement import balancedness, initial_placement, num_physical_experts, rank_loads

    rows = []
    experts, layers, steps = 256, 4, args.window
    gen = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, experts + 1).double() ** args.zipf
    load = torch.zeros(steps, layers, experts)
    for layer in range(layers):
        w = weights[torch.randperm(experts, generator=gen)]
        draws = torch.multinomial(w.expand(steps, -1), 8192, replacement=True, generator=gen)
        load[:, layer] = torch.zeros(steps, experts).scatter_add_(1, draws, torch.ones(steps, 8192))
    for ranks in (8, 32, 64):
        physical = num_physical_experts(experts, 32, ranks)
        topo = Topology(ranks=ranks, slots_per_rank=physical // ranks)
        before = balancedness(rank_loads(load, initial_placement(layers, experts, physical), ranks))
        for name, policy in Plugin(EPLBConfig(num_redundant_experts=32)).deepinfer_placement_policies().items():
            t0 = time.perf_counter()
            placed = policy.place(load, topo)
            rows.append({"ranks": ranks, "policy": name, "logical": experts, "physical": physical,
                         "layers": layers, "window_steps": steps, "balancedness_before": before,
                         "balancedness_after": balancedness(rank_loads(load, placed, ranks)),
                         "policy_seconds_per_layer": (time.perf_counter() - t0) / layers})
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ranks", type=int, default=max(2, torch.cuda.device_count()))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="v2lite")
    parser.add_argument("--eplb-shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--batches", default="16,64,256", help="running requests per rank, comma-separated")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="decode: runs per batch (medians reported)")
    parser.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the skewed router")
    parser.add_argument("--window", type=int, default=32, help="EPLB statistics window (steps)")
    parser.add_argument("--part", action="append", choices=["decode", "eplb", "simulate"],
                        help="repeatable; default: all three")
    parser.add_argument("--dispatch", default="auto",
                        help="decode: kernels.dispatch (torch_all_to_all: exact splits; torch_all_to_all_capacity)")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="decode: parallel.dispatch_capacity_factor (default: the worst-case capacity)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    parts = args.part or ["decode", "eplb", "simulate"]
    if args.device == "cuda":
        for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                            ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(name, value)
    if args.device == "cpu":
        torch.set_num_threads(1)  # as each rank process does (a single process then runs like one rank)
    result: dict[str, Any] = {"device": args.device, "ranks": args.ranks, "torch": torch.__version__}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "decode" in parts:
            result["decode"] = {"shape": args.shape, "input_len": args.input_len, "output_len": args.output_len,
                                "dispatch": args.dispatch, "capacity_factor": args.capacity_factor,
                                "rows": part_decode(args, work)}
        if "eplb" in parts:
            result["eplb"] = {"shape": args.eplb_shape, "zipf": args.zipf, "rows": part_eplb(args, work)}
        if "simulate" in parts:
            result["simulate"] = {"zipf": args.zipf, "rows": part_simulate(args)}
    text = json.dumps(result, indent=2)
    if args.output is not None:
        args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
