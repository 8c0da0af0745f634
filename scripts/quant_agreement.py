"""How far low-precision SmolLM2 runs stray from the float32 one (issue 36 item 2; docs/benchmarks.md).

For each of ``--modes`` (``bf16``: ``model.dtype=bfloat16``; ``int8`` / ``q4_1``: ``model.quantization`` with
int8 inputs, ``int8-w`` / ``q4_1-w`` the same weights with float32 inputs, ``plugins.cpu.quant_inputs``) and
real chat prompts:

* free-running greedy: each run generates ``--tokens`` tokens per prompt (EOS ignored); the token match rate
  is the fraction of positions whose token equals the float32 run's, and the first divergence is reported;
* forced decoding of the float32 run's replies (``golden_token_ids``): step by step through the decode path,
  the share of steps whose most likely token is float32's and the mean extra negative log-likelihood of
  float32's tokens (nats per token) against float32's own;
* teacher-forced on the float32 run's sequences: the engine's own full next-token distributions
  (``LLM.teacher_force`` with ``top_k`` = vocabulary) at the generated positions, against float32's: argmax
  agreement and the mean KL(p_fp32 ‖ p_mode) in nats. Teacher forcing is a prefill (many rows per GEMM); with
  ``plugins.cpu`` it runs oneDNN's GEMM on the rounded weights, so for the weight-only modes it measures the
  format, and free-running decode at ``--max-num-seqs 1`` (one row per GEMM) runs the quantized kernels. The
  int8-input modes send every GEMM call to the quantized kernel (``quant_dense_rows`` unbounded), so both
  measures include the inputs' rounding.

    python scripts/quant_agreement.py --modes bf16 int8 q4_1 --tokens 128 --output agreement.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for staying focused while studying.",
    "Write a short poem about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a simple tomato pasta sauce?",
]

MODES: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "q4_1": {"dtype": "float32", "quantization": "q4_1"},
    # weight-only: the quantized kernels multiply float32 inputs (plugins.cpu.quant_inputs=float32)
    "int8-w": {"dtype": "float32", "quantization": "int8", "inputs": "float32"},
    "q4_1-w": {"dtype": "float32", "quantization": "q4_1", "inputs": "float32"},
}


def build(mode: str, max_num_seqs: int, cpu_settings: dict[str, Any]) -> LLM:
    settings = dict(MODES[mode])
    cpu = {"enabled": True, "quant_inputs": settings.pop("inputs", "int8"), **cpu_settings}
    if "quantization" in settings and cpu["quant_inputs"] == "int8":
        cpu["quant_dense_rows"] = 1 << 30  # every call in the kernel: teacher forcing measures the int8 inputs
    return LLM("smollm2-135m-instruct", plugins={"cpu": cpu}, max_num_seqs=max_num_seqs, **settings)


def generate(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def forced_decode(llm: LLM, prompts: list[list[int]], replies: list[list[int]]) -> tuple[int, float]:
    """Decoding float32's replies token by token (``golden_token_ids``, logprobs of the top token): the steps
    whose most likely token is float32's, and the summed negative log-probability of float32's tokens. Unlike
    teacher forcing (a prefill) this runs the decode path: at ``--max-num-seqs 1`` one row per step."""
    params = [SamplingParams(temperature=0, max_tokens=len(r), ignore_eos=True, golden_token_ids=r, logprobs=1)
              for r in replies]
    agree, nll = 0, 0.0
    for out, reply in zip(llm.generate(prompts, params, use_tqdm=False), replies, strict=True):
        for token, logprobs in zip(reply, out.outputs[0].logprobs, strict=True):
            agree += max(logprobs, key=logprobs.get) == token
            nll -= logprobs[token]
    return agree, nll


def distributions(llm: LLM, sequences: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
    """Per sequence, the float64 log-probabilities ``[generated, vocab]`` predicting each generated token."""
    vocab = llm.engine.model.vocab_size
    out = []
    for seq, start, forced in zip(sequences, starts, llm.teacher_force(sequences, top_k=vocab), strict=True):
        rows = slice(start - 1, len(seq) - 1)
        logits = torch.empty(rows.stop - rows.start, vocab, dtype=torch.float64)
        logits.scatter_(1, forced.top_ids[rows], forced.top_logits[rows].double())
        out.append(torch.log_softmax(logits, dim=-1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["bf16", "int8", "q4_1"], choices=sorted(set(MODES) - {"fp32"}))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=8,
                    help="requests decoded together (1: every decode step has one row, the quantized kernels' path)")
    ap.add_argument("--cpu", nargs="*", default=[], metavar="KEY=VALUE",
                    help="plugins.cpu settings for every run, e.g. fused_decode=false (values parsed as JSON)")
    ap.add_argument("--output")
    args = ap.parse_args()
    cpu_settings = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.cpu)}

    started = time.time()
    ref = build("fp32", args.max_num_seqs, cpu_settings)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    chats = ref.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    prompts = [list(o.prompt_token_ids) for o in chats]
    ref_out = [list(o.outputs[0].token_ids) for o in chats]
    sequences = [p + o for p, o in zip(prompts, ref_out, strict=True)]
    starts = [len(p) for p in prompts]
    ref_logp = distributions(ref, sequences, starts)
    _, ref_nll = forced_decode(ref, prompts, ref_out)
    ref.shutdown()

    report: dict[str, Any] = {"tokens": args.tokens, "max_num_seqs": args.max_num_seqs, "cpu": cpu_settings,
                              "prompts": PROMPTS, "modes": {}}
    for mode in args.modes:
        llm = build(mode, args.max_num_seqs, cpu_settings)
        outs = generate(llm, prompts, args.tokens)
        logp = distributions(llm, sequences, starts)
        decode_agree, decode_nll = forced_decode(llm, prompts, ref_out)
        llm.shutdown()
        equal = [sum(a == b for a, b in zip(o, r, strict=True)) for o, r in zip(outs, ref_out, strict=True)]
        first = [next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), args.tokens)
                 for o, r in zip(outs, ref_out, strict=True)]
        argmax = sum(int((lp.argmax(-1) == rp.argmax(-1)).sum()) for lp, rp in zip(logp, ref_logp, strict=True))
        kl = torch.cat([(rp.exp() * (rp - lp)).sum(-1) for lp, rp in zip(logp, ref_logp, strict=True)])
        positions = sum(len(o) for o in ref_out)
        report["modes"][mode] = {
            "token_match_rate": sum(equal) / positions,
            "identical_sequences": sum(f == args.tokens for f in first),
            "first_divergence": first,
            "teacher_forced_argmax_agreement": argmax / positions,
            "mean_kl_nats": float(kl.mean()),
            "max_kl_nats": float(kl.max()),
            "forced_decode_argmax_agreement": decode_agree / positions,
            "forced_decode_extra_nll_nats": (decode_nll - ref_nll) / positions,  # per token, against float32's
        }
        print(mode, json.dumps(report["modes"][mode]), flush=True)
    report["seconds"] = time.time() - started
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
