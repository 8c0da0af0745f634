"""Prefill FLOPs and time saved by YoCo prefill truncation (``plugins.attention.replay``) against none.

    python scripts/bench_replay.py [--lengths 4096 16384 32768] [--modes off compact mask]
        [--keep-tokens 140] [--repeats 2] [--device cpu|cuda] [--output out.json]

Model, built with ``load_format="dummy"`` and ``kernels.force_balanced_routing`` (each token's experts
uniformly at random), float32 on CPU, bfloat16 on CUDA:
- CPU (default): a small YoCo DeepSeek-V4, hidden 256, 8 layers [SWA, CSA, HCA, CSA | HCA, CSA, HCA, CSA]
  with the last 4 consumers (``yoco_num_producer_layers`` 4), 4 heads of 64, window 128, CSA ratio 4,
  HCA ratio 128, 8 indexer heads of 32 picking 64 entries, 4 hyper-connection streams, 16 experts top-2
  of width 256 + 1 shared, vocabulary 1024.
- ``--device cuda``: the V4-shaped dummy model of ``scripts/deepseek_v4_shaped.json``, the one
  ``tests/test_gpu_deepseek_v4.py`` generates with (hidden 4096, 64 heads of 512, 8 layers with ratios
  [128, 128, 4, 128 | 4, 128, 4, 0], 64 experts top-6 of width 2048, vocabulary 129280), with room for
  40960 positions and the last 4 layers consumers.

Workload per prompt length L: one fresh random prompt per run (prefix caching off), prefilled in chunks
of ``--chunk`` tokens, one token generated; times (wall, and the process's CPU time, steadier on a
shared CPU when run with ``--threads 1``) are medians over ``--repeats`` runs after a short warm-up; on
CUDA also the peak memory allocated while measuring each length (weights and KV pool included).
Modes: ``off``, ``compact`` (consumer layers compute the last ``keep_tokens`` rows only) and ``mask``
(every row computed, windows masked: a correctness mode, expected no faster than off).

FLOPs are counted analytically for ideal kernels (matmuls 2·m·n·k; window attention over
``min(window, p + 1)`` keys, HCA over every complete entry, CSA over its top-k and the indexer over every
complete entry; hyper-connections included; the LM head of one row left out): ``off`` and ``mask``
compute every layer on all L rows; ``compact`` computes the consumer layers' queries, windows, output
projections, MoE and hyper-connections on the last ``keep_tokens`` rows, their compressors on all L.
The reference torch attention this engine runs on CPU attends, per block of up to a window of rows, the
block's window band (at most twice the keys a row sees), every HCA entry up to the block's end and each
row's own CSA picks, so its work stays close to the ideal count. On CUDA, ``triton_v4`` runs prefill
chunks on its sparse kernels (window and top-k / complete entries per query; before issue 11's prefill
path it handed them to that same reference, and the memory notes below are from then).

Memory of ``--device cuda`` (H200, 141 GB; bf16, 2,048-token chunks, 32k prompt): weights 30.2 GB
(15.1B parameters); KV for 32,776 positions 33 MB (124 KiB per 128-token block: compressed entries
and indexer keys only) plus 2.5 MB of state — the pool is fixed at ``KV_BYTES_CUDA`` (1 GiB) rather than
90% of the device; prefill activations under 4 GB: per chunk O(2,048 × hidden × hc_mult) streams and
O(2,048 × heads × head_dim) queries (≤ 0.3 GB each), and the reference attention and indexer in blocks
of query rows with at most ``PREFILL_SCORE_ELEMENTS`` (2^27, 512 MiB) float32 scores per tensor, ≤ 3
alive. Before those blocks, the last chunk's CSA logits alone were [64 heads, 2,048, 127 + 2,048 +
8,192 keys] float32 = 5.4 GB per copy, three alive (16 GB), over the 10% of the device the default KV
budget leaves free. Expected runtime of ``--lengths 4096 16384 32768`` with all three modes: a few
minutes (engine start and dummy weights dominate; the reference's fp32 attention of one 32k ``off``
prefill is ~130 TFLOP).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.deepseek_v4 import CSA, HCA, SLIDING, V4Dims

CPU_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 1024,
    "hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "q_lora_rank": 128, "qk_rope_head_dim": 16, "o_groups": 2, "o_lora_rank": 64,
    "compress_ratios": [0, 4, 128, 4, 128, 4, 128, 4], "num_hash_layers": 1, "sliding_window": 128,
    "index_n_heads": 8, "index_head_dim": 32, "index_topk": 64, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "max_position_embeddings": 40960, "bos_token_id": 0, "eos_token_id": 1,
    "rms_norm_eps": 1e-6, "yoco_num_producer_layers": 4,
}
# The V4-shaped dummy model (shared with tests/test_gpu_deepseek_v4.py), with room for the longest prompts.
CUDA_CONFIG: dict[str, Any] = {**json.loads((Path(__file__).parent / "deepseek_v4_shaped.json").read_text()),
                               "max_position_embeddings": 40960, "yoco_num_producer_layers": 4}
# The CUDA engine's KV pool: V4 caches ~1 KB per token, so 1 GiB holds a million positions and the rest
# of the device stays free for prefill activations (the default takes 90% of it).
KV_BYTES_CUDA = 1 << 30


def layer_flops(d: V4Dims, kind: str, positions: torch.Tensor) -> tuple[float, float]:
    """``(query side, source side)`` FLOPs of one layer over tokens at ``positions``: the source side is
    the compressors (and the indexer's), which a YoCo consumer runs on every row even when truncated."""
    h, m, hd = d.hidden, d.hc_mult, d.head_dim
    n = positions.numel()
    seen = (positions + 1).double()
    hc = 2 * (2 * m * h * (2 + m) * m + 2 * m * m * h)  # two sites: mixes and write-backs
    proj = 2 * h * (d.q_lora + hd) + 2 * d.q_lora * d.heads * hd + 2 * d.heads * hd * d.o_lora
    proj += 2 * d.o_groups * d.o_lora * h
    moe = 2 * h * d.n_routed + (d.top_k + d.n_shared) * 6 * h * d.moe_inter
    attention = 4 * d.heads * hd * seen.clamp(max=d.window).sum().item()
    source = 0.0
    if kind != SLIDING:
        r = d.rates[kind]
        entries = torch.div(seen, r, rounding_mode="floor")
        series = (2 if kind == CSA else 1) * hd
        source += n * 2 * h * 2 * series
        if kind == HCA:
            attention += 4 * d.heads * hd * entries.sum().item()
        else:
            attention += 4 * d.heads * hd * entries.clamp(max=d.index_topk).sum().item()
            proj += 2 * d.q_lora * d.index_heads * d.index_dim + 2 * h * d.index_heads
            attention += 2 * d.index_heads * d.index_dim * entries.sum().item()
            source += n * 2 * h * 2 * 2 * d.index_dim
    return n * (hc + proj + moe) + attention, source


def prefill_flops(d: V4Dims, length: int, keep: int | None) -> float:
    """Prefill FLOPs of a ``length``-token prompt; ``keep``: the rows a compact truncation keeps (None: off)."""
    every = torch.arange(length)
    kept = every[max(0, length - keep):] if keep is not None else every
    total = 0.0
    for i, kind in enumerate(d.layer_types):
        consumer = d.role(i) == "consumer"
        query, _ = layer_flops(d, kind, kept if consumer else every)
        _, source = layer_flops(d, kind, every)
        total += query + source
    return total


def time_prefill(llm: LLM, length: int, vocab: int, repeats: int, seed: int) -> tuple[float, float]:
    """Median ``(wall, process CPU)`` seconds of prefilling a fresh random prompt and generating one token,
    after a warm-up run of at most 512 tokens."""
    gen = torch.Generator().manual_seed(seed)
    wall, cpu = [], []
    for run in range(repeats + 1):
        prompt = torch.randint(2, vocab, (length if run else min(length, 512),), generator=gen).tolist()
        start, start_cpu = time.perf_counter(), time.process_time()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        if llm.engine.device.type == "cuda":
            torch.cuda.synchronize()
        if run:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--modes", nargs="+", default=["off", "compact", "mask"], choices=["off", "compact", "mask"])
    parser.add_argument("--keep-tokens", type=int, default=140)
    parser.add_argument("--chunk", type=int, default=2048, help="scheduler.max_num_batched_tokens")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = CUDA_CONFIG if args.device == "cuda" else CPU_CONFIG
    dims = V4Dims(config)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        max_len = max(args.lengths) + 8
        cache: dict[str, Any] = {"prefix_caching": False}
        if args.device == "cuda":
            cache["kv_cache_bytes"] = KV_BYTES_CUDA
        for mode in args.modes:
            llm = LLM(folder, load_format="dummy", device=args.device, max_model_len=max_len, max_num_seqs=1,
                      max_num_batched_tokens=args.chunk, kernels={"force_balanced_routing": True}, cache=cache,
                      plugins={"attention": {"enabled": True,
                                             "replay": {"mode": mode, "keep_tokens": args.keep_tokens}}})
            for length in args.lengths:
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                seconds, cpu = time_prefill(llm, length, config["vocab_size"], args.repeats, seed=length)
                flops = prefill_flops(dims, length, args.keep_tokens if mode == "compact" else None)
                row = {"mode": mode, "length": length, "seconds": seconds, "cpu_seconds": cpu, "tflops": flops / 1e12}
                peak = ""
                if args.device == "cuda":  # weights and KV pool included
                    row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
                    peak = f"  peak {row['peak_gb']:6.1f} GB"
                rows.append(row)
                print(f"{mode:8s} L={length:6d}  {seconds:8.3f} s wall  {cpu:8.3f} s CPU  {flops / 1e12:9.4f} TFLOP"
                      f"{peak}", flush=True)
            llm.shutdown()
            del llm
            gc.collect()  # one engine at a time: each holds the weights and its KV cache
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(f"\nkeep_tokens={args.keep_tokens}, chunk={args.chunk}, device={args.device}; saved vs off:")
    base = {r["length"]: r for r in rows if r["mode"] == "off"}
    for r in rows:
        off = base.get(r["length"])
        if r["mode"] == "off" or off is None:
            continue
        r["time_saved"] = 1 - r["seconds"] / off["seconds"]
        r["cpu_time_saved"] = 1 - r["cpu_seconds"] / off["cpu_seconds"]
        r["flops_saved"] = 1 - r["tflops"] / off["tflops"]
        print(f"{r['mode']:8s} L={r['length']:6d}  wall {100 * r['time_saved']:5.1f}%  CPU "
              f"{100 * r['cpu_time_saved']:5.1f}%  FLOPs {100 * r['flops_saved']:5.1f}%  "
              f"wall speed-up {off['seconds'] / r['seconds']:.2f}x")
    if args.output:
        args.output.write_text(json.dumps({"config": config, "keep_tokens": args.keep_tokens, "chunk": args.chunk,
                                           "device": args.device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
