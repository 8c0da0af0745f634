"""Make the fp32 CPU reference data that ``tests/test_gpu_deepseek_v4.py`` checks the bf16 CUDA engine against.

    .venv/bin/python scripts/make_gpu_refs_deepseek_v4.py [--out tests/gpu_refs_deepseek_v4]

The DeepSeek-V4 counterpart of ``scripts/make_gpu_refs_deepseek.py`` (same format, prompts and teacher
forcing; no routing margins). The model is ``v4-gpu`` of ``tests/test_deepseek_v4.py::build``: the
``v4-yarn`` config (window 8, CSA ratio 4 with 8 indexer heads, HCA ratio 8, one hash-routed layer, a
non-zero correction bias, 2 hyper-connection streams, YaRN on the compress rope) with ``index_topk`` 32,
more than the compressed entries of any test sequence, and all 8 experts per token, so bf16 cannot flip
an indexer or router choice. The 70-token prompt spans many windows, compression windows and blocks.

It writes ``<out>/v4-gpu/``: the HF folder (fp32 safetensors) and ``ref.pt`` with ``prompts``,
``continuations`` (fp32 greedy, ``CONT_LEN + 1`` tokens), ``logits`` (fp32 transformers logits of the
rows the engine computes) and ``hf_bf16_err``: transformers' own bf16 model (loaded in bf16 from the
folder, so its float32-kept modules stay float32) against the fp32 rows, worst over the prompts
``(max|Δ|/max|ref|, rms(Δ)/rms(ref))``. As a check, deepinfer fp32 on CPU, teacher-forced, must agree
with transformers to 1e-4 of the largest logit.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from test_deepseek_v4 import SEQS, build  # noqa: E402
from test_gpu import CONT_LEN, PROMPT_LENGTHS, make_prompts, teacher_forced_logits  # noqa: E402

NAMES = ("v4-gpu",)


def make_one(name: str, out: Path) -> dict:
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model = build(name, folder)
    vocab = model.config.vocab_size
    prompts = make_prompts(vocab)
    conts, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CONT_LEN + 1,
                                 min_new_tokens=CONT_LEN + 1, do_sample=False)
            cont = gen[0, len(prompt):].tolist()
            rows = model(torch.tensor([prompt + cont[:CONT_LEN]])).logits[0, len(prompt) - 1:].float().contiguous()
            assert rows.shape == (CONT_LEN + 1, vocab)
            assert rows.argmax(-1).tolist() == cont, "greedy continuation disagrees with its own logits"
            conts.append(cont)
            logits.append(rows)
        bf16 = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        hf_errs = []
        for prompt, cont, r in zip(prompts, conts, logits, strict=True):
            o = bf16(torch.tensor([prompt + cont[:CONT_LEN]])).logits[0, len(prompt) - 1:].float()
            hf_errs.append((((o - r).abs().max() / r.abs().max()).item(),
                            ((o - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item()))
    hf_bf16 = (max(e[0] for e in hf_errs), max(e[1] for e in hf_errs))
    ref = {"name": name, "prompts": prompts, "continuations": conts, "logits": logits, "cont_len": CONT_LEN,
           "hf_bf16_err": hf_bf16}
    torch.save(ref, folder / "ref.pt")
    ours = teacher_forced_logits(folder, prompts, [c[:CONT_LEN] for c in conts], dtype="float32", device="cpu",
                                 max_num_seqs=SEQS)
    worst = max(((o - r).abs().max() / r.abs().max()).item() for o, r in zip(ours, logits, strict=True))
    assert worst <= 1e-4, f"{name}: deepinfer fp32 CPU differs from transformers by {worst:.2e} of max|logit|"
    return {"name": name, "bytes": sum(f.stat().st_size for f in folder.iterdir()), "cpu_fp32_rel_err": worst,
            "hf_bf16": hf_bf16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "gpu_refs_deepseek_v4")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for name in NAMES:
        info = make_one(name, args.out)
        print(f"{name:12s} {info['bytes'] / 1e6:6.2f} MB  deepinfer fp32 CPU rel err {info['cpu_fp32_rel_err']:.1e}  "
              f"transformers bf16 CPU max {info['hf_bf16'][0]:.3f} rms {info['hf_bf16'][1]:.3f}")
    print(f"in {args.out} (prompt lengths {PROMPT_LENGTHS}, {CONT_LEN} forced tokens)")


if __name__ == "__main__":
    main()
