"""The DeepSeek-V4 lightning indexer's share of a decode step's attention time, per backend (issue 11).

One V4-Flash-shaped CSA layer (hidden 4096, 64 query heads of 512 with 64 rope channels, q rank 1024,
8 output groups of rank 1024, window 128, compression ratio 4, indexer of 64 heads of 128 keeping the
top 512 entries) with random bf16 weights runs decode steps for ``--batch`` requests of
``--context`` tokens each (default 32k: 8192 compressed entries per request). Per backend (the
``sink_attention`` and ``indexer_topk`` ops both from it) it times, as medians of ``--repeats`` after
``--warmup``:

- ``layer``: the whole attention layer forward (projections, both compressors, indexer, attention,
  output projection), the time a decode step spends in this layer;
- ``indexer``: ``Indexer.select`` (its query and weight projections, then the op ``indexer_topk``);
- ``indexer_op``: the op alone (scores over every entry, then top-k); ``attention_op``: the op
  ``sink_attention`` alone (window + top-k entries with sinks).

and prints the indexer's share of the layer. ``--small`` shrinks the layer and the context for a CPU
smoke run (``TRITON_INTERPRET=1`` lets ``triton_v4`` run there, slowly).

``--prefill``: the ops alone on one prefill chunk instead: one request whose last ``--chunk`` tokens
(default 2,048) are computed, its sequence ending at each ``--context`` position, random bf16 inputs of
the same shape; per backend the medians of ``attn_csa`` (``sink_attention`` of a CSA layer, ratio 4,
each query's top-512 entries), ``attn_hca`` (an HCA layer, ratio 128, every complete entry) and
``indexer_op`` (``indexer_topk``, ratio 4). Only backends serving both ops run (not ``deep_gemm_v4``).

    python scripts/bench_v4_attention.py --batch 1 16 64 --output v4_attention.json
    python scripts/bench_v4_attention.py --prefill --context 8192 32768 --output v4_prefill.json
    TRITON_INTERPRET=1 python scripts/bench_v4_attention.py --small --device cpu --repeats 2
    TRITON_INTERPRET=1 python scripts/bench_v4_attention.py --prefill --small --device cpu --chunk 64 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from deepinfer.interfaces import ForwardContext

CSA = "compressed_sparse_attention"
FLASH = {"hidden_size": 4096, "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
         "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128,
         "index_topk": 512}
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 64, "q_lora_rank": 32, "qk_rope_head_dim": 16,
         "o_groups": 2, "o_lora_rank": 16, "sliding_window": 16, "index_n_heads": 4, "index_head_dim": 16,
         "index_topk": 32}
BLOCK = 128


def backends_by_name() -> dict[str, Any]:
    """The core's reference and the attention plugin's V4 backends, by name (available or not)."""
    from deepinfer_attention.triton_v4 import TritonV4Backend
    from deepinfer_attention.v4_deep_gemm import DeepGemmIndexerBackend

    from deepinfer.model.layers.reference_deepseek_v4 import TorchSinkAttentionBackend

    return {b.name: b for b in (TorchSinkAttentionBackend(), TritonV4Backend(), DeepGemmIndexerBackend())}


def build_layer(shape: dict[str, int], context: int, batch: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[Any, ForwardContext, torch.Tensor]:
    """A CSA layer with random weights and caches holding ``context − 1`` tokens per request; the decode
    context (one new token each) and the layer input ``[batch, hidden]``."""
    from deepinfer.model.deepseek_v4 import V4Attention, V4Dims, V4Rotary

    cfg = {**shape, "num_hidden_layers": 1, "vocab_size": 256, "layer_types": [CSA], "mlp_layer_types": ["moe"],
           "n_routed_experts": 8, "num_experts_per_tok": 2, "compress_rates": {CSA: 4}}
    d = V4Dims(cfg)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rotary = V4Rotary(d.rope_compress, d.rope_dim, context + 1, device)
    layer = V4Attention(d, CSA, rotary, dtype, device)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    per_request = -(-(context + 1) // BLOCK)
    spec = layer.cache_spec("plain")
    paged = spec.allocate(batch * per_request + 1, BLOCK, dtype, device)
    rings = spec.allocate_state(batch + 1, 1, dtype, device)
    for t in (*paged, *rings):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    layer.bind((*paged, *rings))
    tables = (torch.arange(batch * per_request, device=device) + 1).view(batch, per_request)
    lens = [context] * batch
    ctx = ForwardContext(
        positions=torch.full((batch,), context - 1, device=device), slot_mapping=torch.zeros(batch, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, device=device), block_tables=tables, num_decodes=batch,
        query_start_loc_host=list(range(batch + 1)), seq_lens_host=lens, block_size=BLOCK, backends={},
        state_slots=torch.arange(1, batch + 1, device=device), state_slots_host=list(range(1, batch + 1)),
        write_floor_host=[0] * batch, max_query_len=1)
    x = (torch.randn(batch, d.hidden, generator=gen) * 0.5).to(dtype).to(device)
    return layer, ctx, x


def timed(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench(backend: Any, shape: dict[str, int], context: int, batch: int, dtype: torch.dtype, device: torch.device,
          warmup: int, repeats: int) -> dict[str, float]:
    """The four times (module docstring) for one backend and batch, and the indexer's share."""
    from deepinfer.model.deepseek_v4 import _segments
    from deepinfer.model.layers.reference import TorchGemmBackend

    layer, ctx, x = build_layer(shape, context, batch, dtype, device)
    reference = backends_by_name()["torch_v4"]
    ops = {"linear": TorchGemmBackend(),
           "sink_attention": backend if "sink_attention" in backend.ops else reference,
           "indexer_topk": backend}
    ctx.backends = ops
    segments = _segments(ctx)
    indexer = layer.indexer
    d = layer.d
    with torch.no_grad():
        q_latent = layer.q_a_norm(ops["linear"].linear(x, layer.qkv_a_weight)[:, : d.q_lora])
        q = indexer.q_b_weight.new_empty(batch, indexer.heads, indexer.dim).normal_()
        weights = torch.randn(batch, indexer.heads, device=device)
        attn_q = torch.randn(batch, d.heads, d.head_dim, device=device).to(dtype)
        kv = torch.randn(batch, d.head_dim, device=device).to(dtype)
        picks = ops["indexer_topk"].indexer_topk(q, weights, indexer.compressor.paged, ctx, ratio=4,
                                                 topk=indexer.topk, scale=indexer.dim ** -0.5)
        runs = {
            "layer": lambda: layer(ctx.positions, x, x, ctx, segments),
            "indexer": lambda: indexer.select(q_latent, x, ctx.positions, ctx, layer.rotary),
            "indexer_op": lambda: ops["indexer_topk"].indexer_topk(q, weights, indexer.compressor.paged, ctx, ratio=4,
                                                                   topk=indexer.topk, scale=indexer.dim ** -0.5),
            "attention_op": lambda: ops["sink_attention"].sink_attention(
                attn_q, kv, layer.ring, ctx, window=d.window, scale=layer.scale, sinks=layer.sinks,
                compressed=layer.compressor.paged, ratio=4, selected=picks),
        }
        out = {name: timed(fn, device, warmup, repeats) for name, fn in runs.items()}
    out["indexer_share"] = out["indexer"] / out["layer"]
    return out


def prefill_case(shape: dict[str, int], context: int, chunk: int, dtype: torch.dtype, device: torch.device
                 ) -> tuple[ForwardContext, dict[str, torch.Tensor]]:
    """One request's prefill chunk: the context (its last ``chunk`` of ``context`` positions) and random
    inputs of both ops — attention queries and keys, the ring, the paged compressed entries of ratios
    4 and 128, the CSA selections (each query's top-k of random scores over its complete entries) and
    the indexer's queries, weights and paged keys."""
    from deepinfer_attention.triton_v4 import topk_entries

    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype).to(device)

    blocks = -(-context // BLOCK)
    heads, dim, index_dim = shape["num_attention_heads"], shape["head_dim"], shape["index_head_dim"]
    positions = torch.arange(context - chunk, context, device=device)
    ctx = ForwardContext(
        positions=positions, slot_mapping=torch.zeros(chunk, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, chunk], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([context], device=device), block_tables=torch.arange(1, blocks + 1, device=device)[None],
        num_decodes=0, query_start_loc_host=[0, chunk], seq_lens_host=[context], block_size=BLOCK, backends={},
        state_slots=torch.tensor([1], device=device), state_slots_host=[1], write_floor_host=[0], max_query_len=chunk)
    complete = ((positions + 1) // 4)[:, None]
    scores = torch.rand(chunk, context // 4, generator=gen).to(device)
    scores = scores.masked_fill(torch.arange(context // 4, device=device) >= complete, float("-inf"))
    inputs = {
        "q": rand(chunk, heads, dim), "kv": rand(chunk, dim), "ring": rand(2, shape["sliding_window"] + 4, dim),
        "sinks": torch.randn(heads, generator=gen).to(device),
        "csa": rand(blocks + 1, BLOCK // 4, dim), "hca": rand(blocks + 1, BLOCK // 128, dim),
        "selected": topk_entries(scores, shape["index_topk"]),
        "index_q": rand(chunk, shape["index_n_heads"], index_dim),
        "index_w": torch.randn(chunk, shape["index_n_heads"], generator=gen).to(device),
        "index_keys": rand(blocks + 1, BLOCK // 4, index_dim)}
    return ctx, inputs


def bench_prefill(backend: Any, shape: dict[str, int], context: int, chunk: int, dtype: torch.dtype,
                  device: torch.device, warmup: int, repeats: int) -> dict[str, float]:
    """``--prefill``'s times (module docstring) for one backend and context."""
    ctx, x = prefill_case(shape, context, chunk, dtype, device)
    window, scale = shape["sliding_window"], shape["head_dim"] ** -0.5

    def attend(ratio: int) -> torch.Tensor:
        return backend.sink_attention(x["q"], x["kv"], x["ring"], ctx, window=window, scale=scale, sinks=x["sinks"],
                                      compressed=x["csa" if ratio == 4 else "hca"], ratio=ratio,
                                      selected=x["selected"] if ratio == 4 else None)

    runs = {"attn_csa": lambda: attend(4), "attn_hca": lambda: attend(128),
            "indexer_op": lambda: backend.indexer_topk(x["index_q"], x["index_w"], x["index_keys"], ctx, ratio=4,
                                                       topk=shape["index_topk"],
                                                       scale=shape["index_head_dim"] ** -0.5)}
    with torch.no_grad():
        out = {name: timed(fn, device, warmup, repeats) for name, fn in runs.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="*", default=None, help="default: every available one")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[32768])
    parser.add_argument("--prefill", action="store_true", help="time one prefill chunk per context (docstring)")
    parser.add_argument("--chunk", type=int, default=2048, help="--prefill: query rows of the chunk")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny layer and 1k context (CPU smoke run)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SMALL if args.small else FLASH
    contexts = [min(c, 1024) for c in args.context] if args.small else args.context
    found = backends_by_name()
    names = args.backends or [n for n, b in found.items() if b.available() and device.type in b.capabilities.devices]
    results = []
    if args.prefill:
        names = [n for n in names if found[n].ops >= {"sink_attention", "indexer_topk"}]
        print(f"{'backend':>14} {'context':>7} {'chunk':>5} {'attn csa':>9} {'attn hca':>9} {'idx op':>9}")
        for name in names:
            for context in contexts:
                chunk = min(args.chunk, context)
                row = bench_prefill(found[name], shape, context, chunk, dtype, device, args.warmup, args.repeats)
                results.append({"backend": name, "context": context, "chunk": chunk, **row})
                print(f"{name:>14} {context:>7} {chunk:>5} {row['attn_csa']:>9.3f} {row['attn_hca']:>9.3f} "
                      f"{row['indexer_op']:>9.3f}")
    else:
        print(f"{'backend':>14} {'context':>7} {'batch':>5} {'layer ms':>9} {'indexer':>8} {'idx op':>8} "
              f"{'attn op':>8} {'share':>6}")
        for name in names:
            for context in contexts:
                for batch in args.batch:
                    row = bench(found[name], shape, context, batch, dtype, device, args.warmup, args.repeats)
                    results.append({"backend": name, "batch": batch, "context": context, **row})
                    print(f"{name:>14} {context:>7} {batch:>5} {row['layer']:>9.3f} {row['indexer']:>8.3f} "
                          f"{row['indexer_op']:>8.3f} {row['attention_op']:>8.3f} {row['indexer_share']:>6.1%}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": str(device), "shape": shape, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
