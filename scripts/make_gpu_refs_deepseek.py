"""Make the fp32 CPU reference data that ``tests/test_gpu_deepseek.py`` checks the bf16 CUDA engine against.

    .venv/bin/python scripts/make_gpu_refs_deepseek.py [--out tests/gpu_refs_deepseek]

The DeepSeek counterpart of ``scripts/make_gpu_refs.py`` (same format, same prompts, same teacher
forcing). The models are tiny random DeepSeek configs built by ``tests/test_deepseek_v3.py::_build``
(weights std 0.15, norms 1 ± 0.1, a non-zero ``e_score_correction_bias``):

- ``v3-yarn``: V3 with ``q_lora_rank``, YaRN with mscale, interleaved rope, noaux_tc routing over 2
  groups (keep 1), one dense layer then MoE;
- ``v2-grouped``: V2 without ``q_lora_rank``, softmax routing, ``group_limited_greedy``, YaRN as V2 ships it.

``v3-noqlora`` (every layer MoE, top-3 of 2 kept groups) is left out: its folder would push the total
past 3 MB, and on it transformers' own bf16 model already differs from fp32 by 0.32 x max|ref| (bf16
rounding flips expert choices at near-ties), so it could not check anything at bf16 tolerance.

For each it writes ``<out>/<name>/``: the HF folder (fp32 safetensors) and ``ref.pt`` with ``prompts``,
``continuations`` (fp32 greedy, ``CONT_LEN + 1`` tokens), ``logits`` (fp32 transformers logits of the
rows the engine computes, ``[CONT_LEN + 1, vocab]`` per prompt) and, for calibrating the bf16
tolerance, ``hf_bf16_err``: transformers' *own* bf16 model (same weights, on CPU) against the fp32
rows, as ``(max|Δ|/max|ref|, rms(Δ)/rms(ref))`` worst over the prompts. As a check, deepinfer fp32 on
CPU, teacher-forced, must agree with transformers to 1e-4 of the largest logit.

``ref.pt`` also holds the fp32 routing margins per row (``[CONT_LEN + 1]`` per prompt), from the
transformers routers' own fp32 logits on the teacher-forced sequence. A token's margin in one MoE layer
is the smaller of (a) the gap between the last kept group's score and the best dropped group's score
(only where group-limited routing drops groups) and (b) the gap between the k-th and (k+1)-th selection
score among the kept experts. Two per-row minima are stored:

- ``routing_margin``: over every MoE layer, at the row's own position (its own expert choices);
- ``routing_margin_context``: over the MoE layers that an attention layer follows (all but the last),
  at every position <= the row, whose flips reach the row through the later layers' KV.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from test_deepseek_v3 import _build  # noqa: E402
from test_gpu import CONT_LEN, PROMPT_LENGTHS, make_prompts, teacher_forced_logits  # noqa: E402

NAMES = ("v2-grouped", "v3-yarn")


def _token_margins(gate: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``[T]`` fp32 routing margin of each token in one MoE layer (transformers' router ``gate``)."""
    logits = logits.float()
    e = logits.shape[-1]
    if hasattr(gate, "e_score_correction_bias"):  # V3 noaux_tc: sigmoid + bias, group score = top-2 sum
        choice = logits.sigmoid() + gate.e_score_correction_bias.float()
        g = gate.num_group
        group_scores = choice.view(-1, g, e // g).topk(2, dim=-1).values.sum(dim=-1)
    else:  # V2 softmax; group_limited_greedy: group score = max
        choice = logits.softmax(dim=-1)
        g = gate.num_group if gate.topk_method == "group_limited_greedy" else 1
        group_scores = choice.view(-1, g, e // g).amax(dim=-1)
    kept = gate.topk_group if g > 1 else g
    margin = torch.full((choice.shape[0],), float("inf"))
    if g > kept:
        s = group_scores.sort(dim=-1, descending=True).values
        margin = s[:, kept - 1] - s[:, kept]
        keep = group_scores.topk(kept, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // g, dim=1), float("-inf"))
    if kept * (e // g) > gate.top_k:
        s = choice.sort(dim=-1, descending=True).values
        margin = torch.minimum(margin, s[:, gate.top_k - 1] - s[:, gate.top_k])
    return margin


def routing_margins(model: torch.nn.Module, ids: list[int], first_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(own, context)`` per row from ``first_row`` on: see the module docstring."""
    records: list[tuple[torch.nn.Module, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda mod, _i, out: records.append((mod, out[0])))
             for n, m in model.named_modules() if n.endswith("mlp.gate")]
    try:
        model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    per_layer = torch.stack([_token_margins(gate, lg) for gate, lg in records])  # [MoE layers, T]
    own = per_layer.amin(dim=0)[first_row:]
    context = torch.full_like(own, float("inf"))
    if len(records) > 1:
        context = per_layer[:-1].amin(dim=0).cummin(dim=0).values[first_row:]
    return own.contiguous(), context.contiguous()


def make_one(name: str, out: Path) -> dict:
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model = _build(name, folder)
    vocab = model.config.vocab_size
    prompts = make_prompts(vocab)
    conts, logits, own_m, ctx_m = [], [], [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CONT_LEN + 1,
                                 min_new_tokens=CONT_LEN + 1, do_sample=False)
            cont = gen[0, len(prompt):].tolist()
            assert len(cont) == CONT_LEN + 1
            rows = model(torch.tensor([prompt + cont[:CONT_LEN]])).logits[0, len(prompt) - 1:].float().contiguous()
            assert rows.shape == (CONT_LEN + 1, vocab)
            assert rows.argmax(-1).tolist() == cont, "greedy continuation disagrees with its own logits"
            conts.append(cont)
            logits.append(rows)
            own, ctx = routing_margins(model, prompt + cont[:CONT_LEN], len(prompt) - 1)
            own_m.append(own)
            ctx_m.append(ctx)
        # transformers' own bf16 error on the same teacher-forced rows (the calibration of the tolerance)
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        hf_errs = []
        for prompt, cont, r in zip(prompts, conts, logits, strict=True):
            o = bf16(torch.tensor([prompt + cont[:CONT_LEN]])).logits[0, len(prompt) - 1:].float()
            hf_errs.append(((o - r).abs().max() / r.abs().max()).item())
            hf_errs[-1] = (hf_errs[-1], ((o - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item())
    hf_bf16 = (max(e[0] for e in hf_errs), max(e[1] for e in hf_errs))
    ref = {"name": name, "prompts": prompts, "continuations": conts, "logits": logits, "cont_len": CONT_LEN,
           "hf_bf16_err": hf_bf16, "routing_margin": own_m, "routing_margin_context": ctx_m}
    torch.save(ref, folder / "ref.pt")

    ours = teacher_forced_logits(folder, prompts, [c[:CONT_LEN] for c in conts], dtype="float32", device="cpu")
    worst = max(((o - r).abs().max() / r.abs().max()).item() for o, r in zip(ours, logits, strict=True))
    assert worst <= 1e-4, f"{name}: deepinfer fp32 CPU differs from transformers by {worst:.2e} of max|logit|"
    margins = torch.cat([r.topk(2, dim=-1).values.diff(dim=-1).neg().squeeze(-1) for r in logits])
    return {"name": name, "bytes": sum(f.stat().st_size for f in folder.iterdir()),
            "max_abs_logit": max(r.abs().max().item() for r in logits), "min_margin": margins.min().item(),
            "cpu_fp32_rel_err": worst, "hf_bf16": hf_bf16,
            "margins": [" ".join(f"{x:.3f}" for x in m.tolist()) for m in own_m]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "gpu_refs_deepseek")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    total = 0
    for name in NAMES:
        info = make_one(name, args.out)
        total += info["bytes"]
        print(f"{name:12s} {info['bytes'] / 1e6:6.2f} MB  max|logit| {info['max_abs_logit']:7.3f}  "
              f"min top-2 margin {info['min_margin']:.4f}  deepinfer fp32 CPU rel err {info['cpu_fp32_rel_err']:.1e}  "
              f"transformers bf16 CPU max {info['hf_bf16'][0]:.3f} rms {info['hf_bf16'][1]:.3f}")
        for k, line in enumerate(info["margins"]):
            print(f"    prompt {k} own-row routing margins: {line}")
    print(f"total {total / 1e6:.2f} MB in {args.out} (prompt lengths {PROMPT_LENGTHS}, {CONT_LEN} forced tokens)")


if __name__ == "__main__":
    main()
