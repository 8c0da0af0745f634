"""GPU benchmark of the Triton paged decode attention (plugins/attention): time per layer and achieved
bandwidth, one JSON line per (shape, batch, context).

Every request of the batch decodes one token over ``context`` cached keys, paged in the engine's
128-token blocks in shuffled order. ``kernel_us`` times the kernel alone (split-KV + merge);
``layer_us`` the backend op a model layer calls (cache write, and for MLA the absorption through
``W_UK`` and ``W_UV``); ``reference_us`` (``--reference``) the core's torch backend on the same step.
Bandwidth is the cache bytes a decode step must read (K and V rows, or MLA's latent rows) over the
kernel time. Times are medians of ``--repeats`` calls timed with CUDA events after ``--warmup``, each
queued behind a short busy-wait kernel so host launch latency is excluded.

    python scripts/bench_attention.py                       # every shape, batch 1/16/64/256, 1k/8k/32k
    python scripts/bench_attention.py --shapes mla-v3 --batch 1 64 --context 8192 --reference

``--kv-dtype fp8`` reads an FP8 cache instead (``deepinfer/kv/fp8.py``: e4m3 rows with one UE8M0 scale byte
per 32 elements, dequantized in the kernel); ``kv_bytes`` then counts the data and scale bytes, and
``layer_us`` includes quantizing the step's rows on write. ``--kv-dtype bf16 fp8`` times both caches on the
same point (the FP8 cache is the bf16 one quantized) and adds a line with ``fp8_speedup`` = bf16 kernel time
over FP8 kernel time. ``--configs`` also times the kernel at each listed tile configuration
``BLOCK_N,NUM_WARPS,NUM_STAGES`` (``config_us``, and ``best_config``), to pick a launch default.

    python scripts/bench_attention.py --shapes gqa-llama8b mla-v2lite --batch 1 16 64 256 --context 8192 32768 \
        --kv-dtype bf16 fp8 --configs 32,4,2 64,4,2 64,8,2 --warmup 3 --repeats 15     # ~2 min on an H200

``--prefill`` times prefill attention instead (GQA shapes): one prompt of ``--prompt-len`` tokens answered
whole, for each of ``--windows`` (0 = full causal attention): ``kernel_us`` the Triton prefill kernel,
``layer_us`` the backend op (cache write included), ``reference_us`` the core's torch backend (skipped
above ``--reference-max-len`` tokens or when out of memory), ``tflops`` the kernel's useful FLOPs
(``4 · heads · head_dim`` per visible query–key pair) per second; one line per ``--kv-dtype`` (the FP8
cache is the bf16 one quantized).

    python scripts/bench_attention.py --prefill --shapes gqa-llama8b --reference   # 4k/16k/32k, window 0/4096
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from deepinfer_attention.split_kv import choose_num_splits
from deepinfer_attention.triton_backends import TritonAttentionBackend, TritonMLABackend
from deepinfer_attention.triton_decode import paged_gqa_attention
from deepinfer_attention.triton_mla import default_block_h, paged_mla_attention
from deepinfer_attention.triton_prefill import paged_prefill_attention

from deepinfer.interfaces import ForwardContext
from deepinfer.kv import fp8
from deepinfer.model.layers.reference import TorchAttentionBackend
from deepinfer.model.layers.reference_deepseek import TorchMLABackend

BLOCK_SIZE = 128
# name: ("gqa", q heads, kv heads, head dim) or ("mla", heads, latent C, rope R, nope N, value V)
SHAPES = {
    "gqa-smollm2": ("gqa", 9, 3, 64),
    "gqa-llama8b": ("gqa", 32, 8, 128),
    "mla-v3": ("mla", 128, 512, 64, 128, 128),
    "mla-v2lite": ("mla", 16, 512, 64, 128, 128),
}


def time_us(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median microseconds of ``repeats`` calls, each between two CUDA events. A ~1 ms busy-wait kernel
    runs first, so the call's kernels are all queued before the device reaches them: the time is the
    device's, not the host's launch latency (what a CUDA-graph replay sees)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def time_or_oom(fn: Callable[[], object], repeats: int) -> float | str:
    """``time_us`` with one warm-up call, or ``"out of memory"`` (the reference gathers the whole
    context, which does not fit at the largest points)."""
    try:
        return time_us(fn, 1, repeats)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "out of memory"


def decode_context(batch: int, context: int, num_blocks: int, gen: torch.Generator) -> ForwardContext:
    """A decode step of ``batch`` requests at ``context`` keys each, in shuffled distinct blocks."""
    per_request = -(-context // BLOCK_SIZE)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[:batch * per_request] + 1).view(batch, per_request)
    positions = torch.full((batch,), context - 1, dtype=torch.int64)
    slots = tables[:, (context - 1) // BLOCK_SIZE] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    return ForwardContext(
        positions=positions.cuda(), slot_mapping=slots.cuda(),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), context, dtype=torch.int64, device="cuda"), block_tables=tables.cuda(),
        num_decodes=batch, query_start_loc_host=list(range(batch + 1)), seq_lens_host=[context] * batch,
        block_size=BLOCK_SIZE, backends={})


def quantized(rows: torch.Tensor, splits: list[int], chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows [blocks, ..., W]`` as an FP8 cache tensor and its scales, groups of 32 restarting at each of the
    ``splits`` (widths summing to ``W``; MLA: latent, then rope key), ``chunk`` blocks at a time so the
    float32 intermediates of a 30 GiB cache fit beside it."""
    data = torch.empty(rows.shape, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(*rows.shape[:-1], sum(fp8.num_groups(w) for w in splits), dtype=torch.uint8,
                         device=rows.device)
    for b in range(0, rows.shape[0], chunk):
        parts = [fp8.quantize(part) for part in rows[b:b + chunk].split(splits, dim=-1)]
        data[b:b + chunk] = torch.cat([d.view(torch.uint8) for d, _ in parts], dim=-1)
        scales[b:b + chunk] = torch.cat([sc for _, sc in parts], dim=-1)
    return data.view(fp8.FP8_DTYPE), scales


def parse_config(text: str) -> tuple[int, int, int]:
    """``--configs`` entry ``BLOCK_N,NUM_WARPS,NUM_STAGES`` → its three integers."""
    block_n, num_warps, num_stages = (int(x) for x in text.split(","))
    return block_n, num_warps, num_stages


def timings(kernel: Callable[..., object], layer: Callable[[], object], args: argparse.Namespace) -> dict:
    """``kernel_us`` (launch defaults), ``layer_us`` and, with ``--configs``, ``config_us`` (per
    ``BLOCK_N,NUM_WARPS,NUM_STAGES``) and the fastest of them, ``best_config``. ``kernel(block_n, num_warps,
    num_stages)`` runs the kernel, ``None`` meaning the launch default."""
    result = {"kernel_us": time_us(lambda: kernel(None, None, None), args.warmup, args.repeats),
              "layer_us": time_us(layer, args.warmup, args.repeats)}
    if args.configs:
        result["config_us"] = {c: round(time_us(lambda c=c: kernel(*parse_config(c)), args.warmup, args.repeats), 2)
                               for c in args.configs}
        result["best_config"] = min(result["config_us"], key=result["config_us"].get)
    return result


def bench_gqa(shape: tuple, batch: int, context: int, args: argparse.Namespace,
              gen: torch.Generator) -> dict[str, dict]:
    """Per ``--kv-dtype``, the timings of one GQA decode step (the FP8 cache is the bf16 one quantized)."""
    _, q_heads, kv_heads, dim = shape
    num_blocks = batch * -(-context // BLOCK_SIZE) + 1
    dtype = torch.bfloat16
    bf16_cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, dim, dtype=dtype, device="cuda")
    ctx = decode_context(batch, context, num_blocks, gen)
    q = torch.randn(batch, q_heads, dim, dtype=dtype, device="cuda")
    k = torch.randn(batch, kv_heads, dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    scale = dim ** -0.5
    backend, reference = TritonAttentionBackend(), TorchAttentionBackend()
    splits = choose_num_splits(batch * kv_heads, ctx.block_tables.shape[1] * BLOCK_SIZE, q.device)
    results = {}
    for kv_dtype in args.kv_dtype:
        scales: dict[str, torch.Tensor] = {}
        k_cache, v_cache = bf16_cache[0], bf16_cache[1]
        if kv_dtype == "fp8":
            (k_cache, scales["k_scales"]), (v_cache, scales["v_scales"]) = quantized(k_cache, [dim]), \
                quantized(v_cache, [dim])
        kv_cache = (k_cache, v_cache, *scales.values())

        def kernel(block_n: int | None, num_warps: int | None, num_stages: int | None,
                   k_cache: torch.Tensor = k_cache, v_cache: torch.Tensor = v_cache,
                   scales: dict = scales) -> torch.Tensor:
            return paged_gqa_attention(q, k_cache, v_cache, ctx.block_tables, ctx.positions, None, scale=scale,
                                       block_n=block_n, num_warps=num_warps, num_stages=num_stages, **scales)

        result = {"splits": splits, **timings(
            kernel, lambda kv_cache=kv_cache: backend.paged_attention(q, k, v, kv_cache, ctx, scale=scale), args)}
        result["kv_bytes"] = 2 * batch * context * kv_heads * (k_cache[0, 0, 0].nbytes
                                                              + (fp8.num_groups(dim) if scales else 0))
        if args.reference:
            result["reference_us"] = time_or_oom(
                lambda kv_cache=kv_cache: reference.paged_attention(q, k, v, kv_cache, ctx, scale=scale), args.repeats)
        results[kv_dtype] = result
    return results


def bench_mla(shape: tuple, batch: int, context: int, args: argparse.Namespace,
              gen: torch.Generator) -> dict[str, dict]:
    """Per ``--kv-dtype``, the timings of one absorbed-MLA decode step (the FP8 cache is the bf16 one
    quantized)."""
    _, heads, latent_dim, rope_dim, nope, v_dim = shape
    num_blocks = batch * -(-context // BLOCK_SIZE) + 1
    dtype = torch.bfloat16
    bf16_cache = torch.randn(num_blocks, BLOCK_SIZE, latent_dim + rope_dim, dtype=dtype, device="cuda")
    ctx = decode_context(batch, context, num_blocks, gen)
    q_nope = torch.randn(batch, heads, nope, dtype=dtype, device="cuda")
    q_pe = torch.randn(batch, heads, rope_dim, dtype=dtype, device="cuda")
    latent = torch.randn(batch, latent_dim, dtype=dtype, device="cuda")
    k_pe = torch.randn(batch, rope_dim, dtype=dtype, device="cuda")
    kv_b = torch.randn(heads * (nope + v_dim), latent_dim, dtype=dtype, device="cuda") * latent_dim ** -0.5
    q_lat = torch.randn(batch, heads, latent_dim, dtype=dtype, device="cuda")
    scale = (nope + rope_dim) ** -0.5
    backend, reference = TritonMLABackend(), TorchMLABackend()
    head_blocks = -(-heads // default_block_h(heads))
    splits = choose_num_splits(batch * head_blocks, ctx.block_tables.shape[1] * BLOCK_SIZE, q_nope.device)
    results = {}
    for kv_dtype in args.kv_dtype:
        cache, scales = bf16_cache, None
        if kv_dtype == "fp8":
            cache, scales = quantized(bf16_cache, [latent_dim, rope_dim])
        layer_cache = (cache,) if scales is None else (cache, scales)

        def kernel(block_n: int | None, num_warps: int | None, num_stages: int | None, cache: torch.Tensor = cache,
                   scales: torch.Tensor | None = scales) -> torch.Tensor:
            return paged_mla_attention(q_lat, q_pe, cache, ctx.block_tables, ctx.positions, None, scale=scale,
                                       block_n=block_n, num_warps=num_warps, num_stages=num_stages, scales=scales)

        def layer(layer_cache: tuple = layer_cache) -> torch.Tensor:
            return backend.mla_attention(q_nope, q_pe, latent, k_pe, layer_cache, ctx, kv_b_weight=kv_b, scale=scale)

        result = {"splits": splits, **timings(kernel, layer, args)}
        result["kv_bytes"] = batch * context * (cache[0, 0].nbytes + (0 if scales is None else scales.shape[-1]))
        if args.reference:
            result["reference_us"] = time_or_oom(
                lambda layer_cache=layer_cache: reference.mla_attention(q_nope, q_pe, latent, k_pe, layer_cache, ctx,
                                                                        kv_b_weight=kv_b, scale=scale), args.repeats)
        results[kv_dtype] = result
    return results


def prefill_context(prompt: int, num_blocks: int, gen: torch.Generator) -> ForwardContext:
    """A step that prefills one request's whole ``prompt`` tokens, in shuffled distinct blocks."""
    blocks = -(-prompt // BLOCK_SIZE)
    table = (torch.randperm(num_blocks - 1, generator=gen)[:blocks] + 1).view(1, blocks)
    positions = torch.arange(prompt)
    slots = table[0, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    return ForwardContext(
        positions=positions.cuda(), slot_mapping=slots.cuda(),
        query_start_loc=torch.tensor([0, prompt], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([prompt], device="cuda"), block_tables=table.cuda(), num_decodes=0,
        query_start_loc_host=[0, prompt], seq_lens_host=[prompt], block_size=BLOCK_SIZE, backends={})


def bench_prefill(shape: tuple, prompt: int, window: int, kv_dtype: str, args: argparse.Namespace,
                  gen: torch.Generator) -> dict:
    _, q_heads, kv_heads, dim = shape
    num_blocks = -(-prompt // BLOCK_SIZE) + 1
    dtype = torch.bfloat16
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, dim, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    scales: dict[str, torch.Tensor] = {}
    if kv_dtype == "fp8":
        (k_cache, scales["k_scales"]), (v_cache, scales["v_scales"]) = quantized(k_cache, [dim]), \
            quantized(v_cache, [dim])
    kv_cache = (k_cache, v_cache, *scales.values())
    ctx = prefill_context(prompt, num_blocks, gen)
    q = torch.randn(prompt, q_heads, dim, dtype=dtype, device="cuda")
    k = torch.randn(prompt, kv_heads, dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    scale = dim ** -0.5
    backend, reference = TritonAttentionBackend(), TorchAttentionBackend()
    band = window if window > 0 else prompt
    pairs = sum(min(p + 1, band) for p in range(prompt))  # visible (query, key) pairs
    result = {
        "kernel_us": time_us(lambda: paged_prefill_attention(q, k_cache, v_cache, ctx.block_tables, ctx.positions,
                                                             ctx.query_start_loc_host, [0], scale=scale,
                                                             window=window, **scales), args.warmup, args.repeats),
        "layer_us": time_us(lambda: backend.paged_attention(q, k, v, kv_cache, ctx, scale=scale, window=window),
                            args.warmup, args.repeats),
    }
    result["tflops"] = 4 * q_heads * dim * pairs / (result["kernel_us"] * 1e-6) / 1e12
    if args.reference:
        result["reference_us"] = "skipped: over --reference-max-len" if prompt > args.reference_max_len else \
            time_or_oom(lambda: reference.paged_attention(q, k, v, kv_cache, ctx, scale=scale, window=window),
                        args.repeats)
    return result


def run_prefill(args: argparse.Namespace, gen: torch.Generator) -> None:
    """``--prefill``: one JSON line per (GQA shape, prompt length, window, cache dtype)."""
    device = torch.cuda.get_device_name()
    for name in args.shapes:
        if SHAPES[name][0] != "gqa":
            continue  # MLA prefill runs in the core's reference (README.md)
        for prompt in args.prompt_len:
            for window in args.windows:
                for kv_dtype in args.kv_dtype:
                    row = {"mode": "prefill", "shape": name, "prompt": prompt, "window": window, "kv_dtype": kv_dtype,
                           "device": device}
                    try:
                        result = bench_prefill(SHAPES[name], prompt, window, kv_dtype, args, gen)
                    except torch.cuda.OutOfMemoryError as exc:
                        print(json.dumps({**row, "skipped": f"out of memory: {exc}"[:200]}), flush=True)
                        torch.cuda.empty_cache()
                        continue
                    print(json.dumps({**row, **{k: round(v, 2) if isinstance(v, float) else v
                                                for k, v in result.items()}}), flush=True)
                    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--context", nargs="+", type=int, default=[1024, 8192, 32768])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--reference", action="store_true", help="also time the core's torch backend")
    parser.add_argument("--max-cache-gib", type=float, default=48.0,
                        help="skip points whose cache would exceed this many GiB")
    parser.add_argument("--kv-dtype", nargs="+", choices=["bf16", "fp8"], default=["bf16"],
                        help="the cache's storage (fp8: e4m3 + UE8M0 scales per 32, kv/fp8.py); "
                             "both: timed on the same points (decode: with their ratio)")
    parser.add_argument("--configs", nargs="+", default=[], metavar="BLOCK_N,NUM_WARPS,NUM_STAGES",
                        help="decode: also time the kernel at these tile configurations")
    parser.add_argument("--prefill", action="store_true", help="time prefill attention instead of decode")
    parser.add_argument("--prompt-len", nargs="+", type=int, default=[4096, 16384, 32768])
    parser.add_argument("--windows", nargs="+", type=int, default=[0, 4096], help="sliding windows (0 = full)")
    parser.add_argument("--reference-max-len", type=int, default=32768,
                        help="--prefill: time the reference only up to this many prompt tokens")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    if args.prefill:
        run_prefill(args, gen)
        return
    device = torch.cuda.get_device_name()
    for name in args.shapes:
        shape = SHAPES[name]
        for context in args.context:
            for batch in args.batch:
                row = {"shape": name, "batch": batch, "context": context, "device": device}
                per_token = 2 * shape[2] * shape[3] if shape[0] == "gqa" else shape[2] + shape[3]
                if batch * context * per_token * 2 > args.max_cache_gib * 2**30:
                    print(json.dumps({**row, "skipped": f"cache over {args.max_cache_gib} GiB"}), flush=True)
                    continue
                try:
                    results = (bench_gqa if shape[0] == "gqa" else bench_mla)(shape, batch, context, args, gen)
                except torch.cuda.OutOfMemoryError as exc:
                    print(json.dumps({**row, "skipped": f"out of memory: {exc}"[:200]}), flush=True)
                    torch.cuda.empty_cache()
                    continue
                for kv_dtype, result in results.items():
                    result["gb_per_s"] = result["kv_bytes"] / (result["kernel_us"] * 1e-6) / 1e9
                    print(json.dumps({**row, "kv_dtype": kv_dtype, **{k: round(v, 2) if isinstance(v, float) else v
                                                                      for k, v in result.items()}}), flush=True)
                if len(results) == 2:
                    print(json.dumps({**row, "fp8_speedup": round(results["bf16"]["kernel_us"]
                                                                  / results["fp8"]["kernel_us"], 3)}), flush=True)
                torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
