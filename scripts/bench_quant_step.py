"""The GEMMs of one SmolLM2-135M decode step on CPU, every weight streamed from memory (issue 36).

30 layers' fused q/k/v, o, fused gate/up and down projections plus the LM head (121 calls, distinct random
weights, so nothing stays in the 32 MiB L3 between steps), at ``--rows`` input rows, through:

* ``q4_1 int8-in``: ``cpu_q4_1``'s kernel with ``quant_inputs=int8`` (Q4_1 blocks, the head in Q8_0 blocks);
* ``q4_1 f32-in``: the same weights with ``quant_inputs=float32``;
* ``onednn f32``: oneDNN's float32 GEMM on the same weights rounded to float32, packed once (what
  ``cpu_q4_1`` runs for calls of ``quant_dense_rows`` rows or more).

Variants alternate step by step, ``--repeats`` steps each; printed: the median step in milliseconds and the
weight bytes it read over that time (GB/s).

    OMP_NUM_THREADS=2 python scripts/bench_quant_step.py --rows 1 2 4 8 16 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_cpu_gemv_sweep import time_interleaved
from deepinfer_cpu.onednn import OneDNNGemmBackend
from deepinfer_cpu.quant_linear import Int8Weight, Q41Weight, QuantizedLinear, quantize_int8, quantize_q4_1

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in)
HEAD = (49152, 576)


def nbytes(weight: Int8Weight | Q41Weight) -> int:
    if isinstance(weight, Int8Weight):
        return weight.q.numel() + weight.scale.numel() * 4
    return weight.qs.numel() + (weight.d.numel() + weight.m.numel()) * 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    dense = OneDNNGemmBackend(min_rows=1)
    quantized, packed = [], []
    for out, inp in [*LAYER_SHAPES * args.layers, HEAD]:
        w = torch.randn(out, inp, generator=gen) * 0.05
        q = quantize_int8(w, 32) if (out, inp) == HEAD else quantize_q4_1(w)
        quantized.append(q)
        param = torch.nn.Parameter(q.dequantize(), requires_grad=False)
        param.data = dense.prepare_weight(param.data)
        packed.append(param)
    int8_in = [QuantizedLinear(q, "int8") for q in quantized]
    f32_in = [QuantizedLinear(q, "float32") for q in quantized]
    total = sum(nbytes(q) for q in quantized)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(quantized)} GEMMs, "
          f"{total / 1e6:.1f} MB quantized ({sum(p.numel() for p in packed) * 4 / 1e6:.0f} MB as float32)")
    print("| rows | q4_1 int8-in ms (GB/s) | q4_1 f32-in ms (GB/s) | onednn f32 ms |")
    print("|---|---|---|---|")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in {inp for _, inp in LAYER_SHAPES}}
        variants = {
            "int8": lambda inputs=inputs: [layer(inputs[layer.k]) for layer in int8_in],
            "f32": lambda inputs=inputs: [layer(inputs[layer.k]) for layer in f32_in],
            "onednn": lambda inputs=inputs: [dense.linear(inputs[p.shape[1]], p) for p in packed],
        }
        med = {name: statistics.median(v) for name, v in time_interleaved(variants, args.repeats).items()}
        print(f"| {rows} | {med['int8'] * 1e3:.2f} ({total / med['int8'] / 1e9:.1f}) | "
              f"{med['f32'] * 1e3:.2f} ({total / med['f32'] / 1e9:.1f}) | {med['onednn'] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
