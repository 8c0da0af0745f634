"""Decode speed with ``kernels.batch_invariant`` on against the default backends, on one GPU (issue 6).

    python scripts/bench_batch_invariant.py [--model v2lite|smollm2] [--batch 1 16 64] [--repeats 3]
        [--output bench_bi.json]

Models (dummy weights, bf16): ``v2lite`` is the 8-layer DeepSeek-V2-Lite-shaped V3 of
``bench_gpu_deepseek.py`` (MLA + 64 experts top-6, balanced routing forced); ``smollm2`` a Llama with
SmolLM2-135M's shapes (30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152). Both modes run with
the ``attention`` and ``moe`` plugins enabled and ``auto`` backends, so the default mode gets the fastest
backends and the batch-invariant mode gets ``triton_bi`` / ``triton_bi_mla``. Workload per batch B: B
fresh random 128-token prompts, greedy, EOS ignored; each repeat times ``max_tokens=1`` and
``max_tokens=65``; decode tok/s = B · 64 / (t65 − t1), the median of ``--repeats``. Prefill tok/s =
B · 128 / t1 is printed too (the batch-invariant attention has no query tiling).
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
from bench_gpu_deepseek import CONFIG as V2LITE
from bench_gpu_deepseek import PROMPT_LEN

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
NEW = 64


def _prompts(batch: int, seed: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, PROMPT_LEN), generator=gen).tolist()


def bench_mode(folder: Path, vocab: int, batches: list[int], repeats: int, batch_invariant: bool) -> dict:
    """Decode and prefill tok/s per batch size for one mode, and the backends it chose."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(folder), load_format="dummy", dtype="bfloat16", device="cuda", kv_cache_bytes=4 << 30,
              max_num_seqs=max(batches), max_num_batched_tokens=max(4096, max(batches) * PROMPT_LEN),
              kernels={"force_balanced_routing": True, "batch_invariant": batch_invariant},
              plugins={"attention": {"enabled": True}, "moe": {"enabled": True}})
    runner = llm.engine.runner
    backends = {op: b.name for op, b in runner.backends.items() if op in llm.engine.model.backend_ops}
    print(f"batch_invariant={batch_invariant}: backends {backends}; CUDA graphs {runner.graphs is not None}",
          flush=True)
    seed = [1000]

    def timed(batch: int, max_tokens: int) -> float:
        seed[0] += 1
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(_prompts(batch, seed[0], vocab), params, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return dt

    timed(max(batches), 4)  # warm-up: compiles every kernel shape
    runs = {}
    try:
        for batch in batches:
            t1s, t65s = [], []
            for _ in range(repeats):
                t1s.append(timed(batch, 1))
                t65s.append(timed(batch, NEW + 1))
            t1, t65 = statistics.median(t1s), statistics.median(t65s)
            runs[batch] = {"decode_tok_s": batch * NEW / (t65 - t1), "prefill_tok_s": batch * PROMPT_LEN / t1}
            print(f"  B={batch:3d}: decode {runs[batch]['decode_tok_s']:9.1f} tok/s, "
                  f"prefill {runs[batch]['prefill_tok_s']:9.1f} tok/s", flush=True)
    finally:
        llm.shutdown()
    return {"backends": backends, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["v2lite", "smollm2"], default="v2lite")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    config = V2LITE if args.model == "v2lite" else SMOLLM2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(config))
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model}
        for mode in ("default", "batch_invariant"):
            result[mode] = bench_mode(folder, config["vocab_size"], args.batch, args.repeats, mode != "default")
            gc.collect()  # the finished engine's cache and weights go before the next one allocates
            torch.cuda.empty_cache()
    print(f"{'B':>4} {'default tok/s':>14} {'invariant tok/s':>16} {'ratio':>6}")
    for batch in args.batch:
        base = result["default"]["runs"][batch]["decode_tok_s"]
        bi = result["batch_invariant"]["runs"][batch]["decode_tok_s"]
        print(f"{batch:4d} {base:14.1f} {bi:16.1f} {bi / base:6.2f}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
