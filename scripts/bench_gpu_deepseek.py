"""Decode speed of an 8-layer DeepSeek-V2-Lite-shaped dummy V3 model on one GPU (issues 3 and 10), of
the V4-shaped dummy model of ``scripts/deepseek_v4_shaped.json`` (``--shape v4``), or of the
Llama-3-8B-shaped dense dummy model of ``scripts/llama3_8b_shaped.json`` (``--shape llama8b``, issue 29), or
the DeepSeek-V4.1-Flash-shaped one of ``scripts/deepseek_v41_shaped.json`` (``--shape v41``, issue 32; no
transformers run: transformers has no V4.1; run it with ``--eager``: V4.1 steps cannot be captured).

    python scripts/bench_gpu_deepseek.py [--shape v2lite|v4|v41|llama8b] [--batch 1 16 64 256] [--plugins attention moe]
        [--eager] [--kv-dtype auto|fp8] [--output bench.json] [--profile-out prof.txt] [--no-transformers]
        [--length-spread 63] [--expert-dtype bf16|fp4]

Model: ``DeepseekV3ForCausalLM``, hidden 2048, 16 heads, no q_lora, kv_lora 512, rope 64, nope 128,
v 128, 64 routed experts top-6 + 2 shared, moe width 1408, dense width 10944, first layer dense,
vocab 102400, 8 layers, bf16 (n_group 1, routed_scaling_factor 1.0, norm_topk_prob true). deepinfer
builds it with ``load_format="dummy"`` and ``kernels.force_balanced_routing`` (each token's 6 experts
uniformly at random). Workload per batch B: B fresh random prompts (fresh per run, so the prefix cache
never hits) of lengths spread evenly over 128 ± ``--length-spread`` (default 63: 65 … 191 tokens, mean
exactly 128, so the mean KV length matches vLLM's one-length 128-token prompts; B = 1 gets 128), greedy,
EOS ignored. Balanced routing hashes (position, layer, expert), so prompts of one length
(``--length-spread 0``, the method before 2026-12-03) decode in lockstep and every row of a step draws the
same experts: at B >= 16 that reads ~6 experts per layer instead of the ~64 * (1 - (1 - 6/64)^B) counted
below, and flatters the MoE shapes. Each repeat times ``max_tokens=1`` (prefill + first token) and
``max_tokens=65`` on prompts of the same lengths; decode tok/s = B * 64 / (t65 - t1). Median of
``--repeats``: the decode anchor of ``deepinfer/bench/anchor.py`` (``deepinfer bench --decode-anchor``
runs it on any model and puts a peer's result file beside it).

transformers: ``DeepseekV3ForCausalLM`` from the same config, random init on the GPU in bf16 (a
different random model; its router is not forced balanced: transformers has no such switch),
``generate`` with ``max_new_tokens`` 1 and 65 (``min_new_tokens`` equal), timed the same way on
128-token prompts (one length: ``generate`` takes a rectangular batch, and its router is not hashed).

Memory-bandwidth limit: bytes read per decode step (all attention and dense weights, the LM head, the
shared experts, the router, and the expected number of distinct routed experts that B tokens touch
under uniform top-6 routing, 64 * (1 - (1 - 6/64)^B), plus the latent KV of the mean context) over
the copy bandwidth measured here (``dst.copy_(src)`` of 2 GiB, bytes read + written). For ``--shape v4``
the weight bytes are counted from the built model's parameters the same way (routed experts scaled by
the expected distinct fraction, the embedding by B rows, MTP layers excluded), and the KV bytes are the
sliding-window ring plus the compressed entries and indexer keys of the mean context (``--shape v41``:
every compressed layer reads its entries, shared or its own; index sources also read the indexer keys). For ``--shape
llama8b`` likewise from the built model's parameters, with the K and V of every layer's KV heads over
the mean context. The same method as vLLM's anchor (``../shared/tools/vllm/run_vllm.py``), so the two
results compare directly.

Profile: ``torch.profiler`` over 8 decode steps at B = 16 (after prefill and 2 warm-up decode steps; the
prompts' lengths spread as above), top ops by device time, plus device-busy time over wall time; every
kernel's device time and calls per step go to ``<profile-out stem>.kernels.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "first_k_dense_replace": 1,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "rope_theta": 10000.0, "rope_scaling": None, "rope_interleave": True, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16",
    "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
}
V4_CONFIG = json.loads((Path(__file__).parent / "deepseek_v4_shaped.json").read_text())
LLAMA_CONFIG = json.loads((Path(__file__).parent / "llama3_8b_shaped.json").read_text())
V41_CONFIG = json.loads((Path(__file__).parent / "deepseek_v41_shaped.json").read_text())
SHAPES = {"v2lite": CONFIG, "v4": V4_CONFIG, "v41": V41_CONFIG, "llama8b": LLAMA_CONFIG}
PROMPT_LEN, NEW = 128, 64


def text_of(config: dict) -> dict:
    """The text model's keys: V4.1's ``text_config``, or the config itself."""
    return config.get("text_config", config)


def distinct_experts(config: dict, batch: int) -> float:
    """Expected distinct routed experts per layer that ``batch`` uniform top-k tokens touch (0: dense)."""
    config = text_of(config)
    if "n_routed_experts" not in config:
        return 0.0
    e, k = config["n_routed_experts"], config["num_experts_per_tok"]
    return e * (1 - (1 - k / e) ** batch)


def model_step_bytes(model: torch.nn.Module, config: dict, batch: int, ctx: float) -> dict[str, float]:
    """Bytes one decode step of ``batch`` requests at mean context ``ctx`` reads, counted from the built
    model's parameters (routed experts ``w13``/``w2``, or their FP4 bytes and scales, scaled by the distinct
    fraction, the input embedding by ``batch`` rows unless it is also the LM head, MTP layers excluded) plus
    the KV."""
    distinct = distinct_experts(config, batch)
    fraction = distinct / text_of(config)["n_routed_experts"] if distinct else 1.0
    tied = getattr(model, "lm_head", None) is None
    weights = 0.0
    for name, param in model.named_parameters():
        if name.startswith("mtp_layers."):
            continue
        size = param.numel() * param.element_size()
        if name.endswith((".w13", ".w2", ".w13_fp4", ".w13_scale", ".w2_fp4", ".w2_scale")):
            size *= fraction
        elif name == "embed_tokens.weight" and not tied:
            size = batch * param.shape[1] * param.element_size()
        weights += size
    kv = batch * kv_bytes_per_request(config, ctx)
    return {"weight_bytes": weights, "kv_bytes": kv, "distinct_experts": distinct, "total_bytes": weights + kv}


def kv_bytes_per_request(config: dict, ctx: float) -> float:
    """bf16 KV bytes one request at context ``ctx`` reads per decode step (V4 rings and compressed
    entries, or a dense model's K and V heads)."""
    if "text_config" in config:
        return v41_kv_bytes_per_request(config["text_config"], ctx)
    if "compress_ratios" not in config:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * ctx * 2
    kv_per_request = 0.0
    window = config["sliding_window"]
    for ratio in config["compress_ratios"][: config["num_hidden_layers"]]:
        kv_per_request += min(ctx, window) * config["head_dim"] * 2
        if ratio:
            kv_per_request += ctx / ratio * config["head_dim"] * 2
        if ratio == 4:  # CSA layers also keep indexer keys
            kv_per_request += ctx / ratio * config["index_head_dim"] * 2
    return kv_per_request


def v41_kv_bytes_per_request(text: dict, ctx: float) -> float:
    """V4.1: every layer's window ring; every compressed layer its entries (its own or its KV source's);
    every index source the indexer keys of its entries."""
    sources = set(text.get("index_source_layer_ids", range(text["num_hidden_layers"])))
    kv_per_request = 0.0
    for layer, ratio in enumerate(text["compress_ratios"][: text["num_hidden_layers"]]):
        kv_per_request += min(ctx, text["sliding_window"]) * text["head_dim"] * 2
        if ratio:
            kv_per_request += ctx / ratio * text["head_dim"] * 2
            if layer in sources:
                kv_per_request += ctx / ratio * text["index_head_dim"] * 2
    return kv_per_request


def step_bytes(batch: int, ctx: float) -> dict[str, float]:
    c = CONFIG
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn = (h * heads * qk + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
            + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * h)
    e, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    distinct = distinct_experts(c, batch)
    dense_layers = c["first_k_dense_replace"]
    moe_layers = c["num_hidden_layers"] - dense_layers
    params = (c["num_hidden_layers"] * attn + dense_layers * 3 * h * c["intermediate_size"]
              + moe_layers * (3 * h * inter * c["n_shared_experts"] + distinct * 3 * h * inter)
              + c["vocab_size"] * h + batch * h)
    router = moe_layers * e * h * 4  # float32
    kv = batch * ctx * c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
    return {"weight_bytes": params * 2 + router, "kv_bytes": kv, "distinct_experts": distinct,
            "total_bytes": params * 2 + router + kv}


def copy_bandwidth() -> float:
    n = 1 << 30  # 2 GiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)


def prompts(batch: int, seed: int, vocab: int, length_spread: int = 0) -> list[list[int]]:
    from deepinfer.bench.anchor import anchor_prompts

    return anchor_prompts(batch, seed, vocab, PROMPT_LEN, length_spread)


def bench_deepinfer(folder: Path, config: dict, batches: list[int], repeats: int, profile_out: Path | None,
                    plugins: list[str], cuda_graphs: bool, profile_batch: int | None = None,
                    kv_dtype: str = "auto", max_prefill_tokens: int = 32768, compile_mode: str = "off",
                    gemm: str = "auto", length_spread: int = 0, piecewise_max_tokens: int = 2048) -> dict:
    from deepinfer import LLM, SamplingParams
    from deepinfer.bench.anchor import run_anchor

    vocab = text_of(config)["vocab_size"]
    t = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", device="cuda",
              kernels={"force_balanced_routing": True, "cuda_graphs": cuda_graphs, "compile": compile_mode,
                       "piecewise_max_tokens": piecewise_max_tokens,
                       "gemm": gemm},
              cache={"kv_cache_bytes": 4 << 30, "kv_dtype": kv_dtype}, max_num_seqs=max(batches),
              max_num_batched_tokens=min(max_prefill_tokens, max(4096, max(batches) * PROMPT_LEN)),
              plugins={name: {"enabled": True} for name in plugins})
    build_s = time.perf_counter() - t
    graphs = llm.engine.runner.graphs
    ops = getattr(llm.engine.model, "backend_ops", None) or frozenset(llm.engine.runner.backends)
    print(f"deepinfer built in {build_s:.1f} s; backends "
          f"{ {op: b.name for op, b in llm.engine.runner.backends.items() if op in ops} }; "
          f"CUDA graph buckets {graphs.buckets if graphs else None}", flush=True)
    llm.generate(prompts(1, 999, vocab), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up of the one-request path
    result = {"build_s": build_s, "runs": {}, "step_bytes": {}}
    if config is not CONFIG:
        for batch in batches:
            result["step_bytes"][batch] = model_step_bytes(llm.engine.model, config, batch, PROMPT_LEN + NEW / 2)
    for batch in batches:
        before = llm.get_stats()
        run = run_anchor(llm, [batch], repeats=repeats, prompt_len=PROMPT_LEN, decode_tokens=NEW,
                         length_spread=length_spread)[batch]
        after = llm.get_stats()
        busy = after["device_busy_s"] - before["device_busy_s"]
        idle = after["device_idle_s"] - before["device_idle_s"]
        result["runs"][batch] = {**run, "device_busy_s": busy, "device_idle_s": idle,
                                 "device_idle_fraction": idle / (busy + idle) if busy + idle else 0.0}
        print(f"deepinfer B={batch}: decode {run['decode_tok_s_median']:.1f} tok/s "
              f"(runs {[round(x, 1) for x in run['decode_tok_s']]}), prefill+1 {run['prefill_s_median'] * 1000:.1f} "
              f"ms, device idle {100 * result['runs'][batch]['device_idle_fraction']:.1f}% between steps", flush=True)
    if profile_out is not None:
        try:
            result["profile"] = profile_decode(llm, profile_batch or max(batches), profile_out, vocab,
                                               length_spread)
        except Exception as exc:
            result["profile"] = {"error": repr(exc)}
            print(f"profile failed: {exc!r}", flush=True)
    llm.shutdown()
    return result


def profile_steps(engine, warmup: int, steps: int, trace: Path | None = None):
    """``torch.profiler``'s averages over ``steps`` engine steps after ``warmup`` ones, and their wall
    seconds; the engine's requests then run to the end. ``trace``: the timeline written there too (Chrome
    trace format; gzipped when the name ends in ``.gz``)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    while engine.has_unfinished():
        engine.step()
    return prof.key_averages(), wall


def profile_decode(llm, batch: int, out: Path, vocab: int, length_spread: int = 0) -> dict:
    from deepinfer import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for p in prompts(batch, 77, vocab, length_spread):
        engine.add(engine.make_request(p, params))
    steps = 8  # after the prefill (one step: 16 x 128 tokens <= 4096) and 2 decode warm-up steps
    avgs, wall = profile_steps(engine, 3, steps)
    try:
        table = avgs.table(sort_by="self_cuda_time_total", row_limit=25)
    except Exception:
        table = avgs.table(sort_by="self_device_time_total", row_limit=25)
    out.write_text(table)
    print(table, flush=True)

    def dev(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    kernels = [e for e in avgs if dev(e) > 0]
    every = sorted(((e.key, round(dev(e) / steps, 2), e.count / steps) for e in kernels
                    if not e.key.startswith("aten::")), key=lambda x: -x[1])
    out.with_suffix(".kernels.json").write_text(json.dumps(
        {"steps": steps, "columns": ["kernel", "device_us_per_step", "calls_per_step"], "kernels": every}, indent=0))
    total_dev_us = sum(dev(e) for e in kernels if not e.key.startswith("aten::"))
    top = sorted(((e.key, dev(e) / steps / 1000, e.count // steps) for e in kernels if e.key.startswith("aten::")),
                 key=lambda x: -x[1])[:15]
    syncs = {e.key: e.count // steps for e in avgs if e.key in ("cudaStreamSynchronize", "cudaMemcpyAsync",
                                                                  "cudaLaunchKernel", "cudaDeviceSynchronize")}
    summary = {"steps": steps, "wall_ms_per_step": 1000 * wall / steps,
               "device_kernel_ms_per_step": total_dev_us / steps / 1000,
               "top_aten_ops_ms_per_step_and_calls": top, "runtime_calls_per_step": syncs}
    print(json.dumps(summary, indent=1), flush=True)
    return summary


def hf_v4_config(cfg: dict) -> dict:
    """transformers' ``DeepseekV4Config`` arguments for the upstream-style V4 config (same shapes; the
    compress rope is given one set of YaRN parameters, which does not change the speed)."""
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    ratios = cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    heavy = max(ratios)
    skip = ("architectures", "model_type", "compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_theta",
            "compress_rope_theta", "rope_scaling")
    out = {k: v for k, v in cfg.items() if k not in skip}
    out.update(layer_types=[kinds.get(r, "heavily_compressed_attention") for r in ratios],
               mlp_layer_types=["hash_moe"] * cfg["num_hash_layers"] + ["moe"] * (len(ratios) - cfg["num_hash_layers"]),
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": heavy},
               partial_rotary_factor=cfg["qk_rope_head_dim"] / cfg["head_dim"], num_nextn_predict_layers=0,
               rope_parameters={"rope_type": "yarn", "rope_theta": cfg["rope_theta"],
                                **{k: v for k, v in cfg["rope_scaling"].items() if k != "type"}})
    return out


def bench_transformers(config_dict: dict, batches: list[int], repeats: int) -> dict:
    import transformers

    if config_dict is V4_CONFIG:
        config = transformers.DeepseekV4Config(**hf_v4_config(config_dict))
        model_class = transformers.DeepseekV4ForCausalLM
    else:
        cfg = {k: v for k, v in config_dict.items() if k not in ("architectures", "model_type", "torch_dtype")}
        config = transformers.DeepseekV3Config(**cfg)
        model_class = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    t = time.perf_counter()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = model_class(config).eval()
    finally:
        torch.set_default_dtype(old)
    model.to(torch.bfloat16)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t
    info = {"transformers": transformers.__version__, "build_s": build_s,
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
            "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    print(f"transformers {info}", flush=True)

    def timed(batch: int, new: int, seed: int) -> float:
        ids = torch.tensor(prompts(batch, seed, config_dict["vocab_size"]), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        assert out.shape[1] == PROMPT_LEN + new
        return time.perf_counter() - t0

    timed(max(batches), 4, 1)
    timed(1, 4, 2)
    runs = {}
    seed = 100
    for batch in batches:
        t1s, t65s = [], []
        for _ in range(repeats):
            seed += 1
            t1s.append(timed(batch, 1, seed))
            t65s.append(timed(batch, NEW + 1, seed))
        decode = [batch * NEW / (b - a) for a, b in zip(t1s, t65s, strict=True)]
        runs[batch] = {"t1_s": t1s, "t65_s": t65s, "decode_tok_s": decode,
                       "decode_tok_s_median": statistics.median(decode), "prefill_s_median": statistics.median(t1s)}
        print(f"transformers B={batch}: decode {runs[batch]['decode_tok_s_median']:.1f} tok/s "
              f"(runs {[round(x, 1) for x in decode]}), prefill+1 {statistics.median(t1s) * 1000:.1f} ms", flush=True)
    info["runs"] = runs
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="v2lite",
                        help="v2lite: the 8-layer V2-Lite-shaped V3 model; v4: scripts/deepseek_v4_shaped.json; "
                             "v41: scripts/deepseek_v41_shaped.json; llama8b: scripts/llama3_8b_shaped.json")
    parser.add_argument("--kv-dtype", default="auto", help="cache.kv_dtype (auto or fp8)")
    parser.add_argument("--expert-dtype", choices=["bf16", "fp4"], default="bf16",
                        help="--shape v41: quantization_config.expert_dtype (fp4: routed experts stored as e2m1 "
                             "bytes with ue8m0 scales per 32, dummy codes)")
    parser.add_argument("--max-prefill-tokens", type=int, default=32768,
                        help="cap on scheduler.max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--profile-out", type=Path)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--plugins", nargs="*", default=["attention", "moe"],
                        help="plugins to enable (default: attention moe; none: the core's reference backends)")
    parser.add_argument("--eager", action="store_true", help="kernels.cuda_graphs=false")
    parser.add_argument("--profile-batch", type=int, help="batch of the profiled steps (default: the largest)")
    parser.add_argument("--compile", action="store_true",
                        help="kernels.compile=inductor (the fused decode step; build_s then includes compiling)")
    parser.add_argument("--gemm", default="auto", help="kernels.gemm (e.g. triton_gemv: the split-K GEMV for M <= 16)")
    parser.add_argument("--length-spread", type=int, default=63,
                        help="prompt lengths spread evenly over 128 +- this, mean 128 (0: every prompt 128 tokens, "
                             "which decodes balanced routing in lockstep)")
    parser.add_argument("--piecewise-max-tokens", type=int, default=2048,
                        help="kernels.piecewise_max_tokens (0: steps with prompt rows run eagerly)")
    args = parser.parse_args()
    config = SHAPES[args.shape]
    if args.expert_dtype != "bf16":
        if config is not V41_CONFIG:
            parser.error("--expert-dtype needs --shape v41")
        config = {**config, "quantization_config": {"expert_dtype": args.expert_dtype}}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": config,
              "date": time.strftime("%Y-%m-%d"), "plugins": args.plugins, "cuda_graphs": not args.eager,
              "kv_dtype": args.kv_dtype, "compile": "inductor" if args.compile else "off", "gemm": args.gemm,
              "prompt_len_mean": PROMPT_LEN, "length_spread": args.length_spread,
              "piecewise_max_tokens": args.piecewise_max_tokens}
    bw = copy_bandwidth()
    result["copy_bandwidth_bytes_s"] = bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(config))
        result["deepinfer"] = bench_deepinfer(folder, config, args.batch, args.repeats, args.profile_out,
                                              args.plugins, not args.eager, args.profile_batch, args.kv_dtype,
                                              args.max_prefill_tokens, "inductor" if args.compile else "off",
                                              args.gemm, args.length_spread, args.piecewise_max_tokens)
    torch.cuda.empty_cache()
    if not args.no_transformers and args.shape in ("v2lite", "v4"):
        try:
            result["transformers"] = bench_transformers(config, args.batch, args.repeats)
        except Exception as exc:
            result["transformers"] = {"error": repr(exc)}
            print(f"transformers failed: {exc!r}", flush=True)
    limits = {}
    for batch in args.batch:
        b = result["deepinfer"]["step_bytes"].get(batch) or step_bytes(batch, PROMPT_LEN + NEW / 2)
        limits[batch] = {**b, "limit_tok_s": batch * bw / b["total_bytes"],
                         "fraction": result["deepinfer"]["runs"][batch]["decode_tok_s_median"]
                         / (batch * bw / b["total_bytes"])}
        print(f"B={batch}: {b['total_bytes'] / 1e9:.3f} GB/step ({b['distinct_experts']:.1f} experts/layer) "
              f"-> limit {limits[batch]['limit_tok_s']:.0f} tok/s; deepinfer at {100 * limits[batch]['fraction']:.2f}%",
              flush=True)
    result["limits"] = limits
    if args.output:
        args.output.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
