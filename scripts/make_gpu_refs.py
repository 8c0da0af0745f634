"""Make the fp32 CPU reference data that ``tests/test_gpu.py`` checks the bf16 CUDA engine against.

    .venv/bin/python scripts/make_gpu_refs.py [--out tests/gpu_refs]

For every tiny config of ``tests/tiny_models.py`` (llama, llama-tied-llama3rope, qwen2, qwen3) this writes
``<out>/<name>/``: the HF model folder (``save_pretrained``, fp32 safetensors, about 0.4 MB) and
``ref.pt`` (``torch.save`` of a dict):

- ``prompts``: list of token-id lists of mixed lengths (``PROMPT_LENGTHS``; 70 spans five 16-blocks);
- ``continuations``: per prompt, the fp32 greedy continuation of ``CONT_LEN + 1`` tokens (EOS ignored).
  The first ``CONT_LEN`` are fed back teacher-forced; the last one is only predicted;
- ``logits``: per prompt, a float32 ``[CONT_LEN + 1, vocab]`` tensor: the fp32 transformers logits of
  ``prompt + continuation[:CONT_LEN]`` at positions ``len(prompt) - 1 ... len(prompt) + CONT_LEN - 1``,
  i.e. exactly the rows the engine computes in its prefill step and its ``CONT_LEN`` decode steps.

As a check, the same rows are computed by deepinfer itself in fp32 on CPU, teacher-forced through its
prefill + paged decode path (the harness ``tests/test_gpu.py`` uses), and must agree with transformers
to 1e-4 of the largest logit. The script prints the size of what it wrote and, for orientation, the
smallest top-2 margins of the references.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from test_gpu import CONT_LEN, PROMPT_LENGTHS, make_prompts, teacher_forced_logits  # noqa: E402
from tiny_models import TINY, build_tiny  # noqa: E402


def make_one(name: str, out: Path) -> dict:
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    model = build_tiny(name)
    model.save_pretrained(folder)
    vocab = model.config.vocab_size
    prompts = make_prompts(vocab)
    conts, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CONT_LEN + 1,
                                 min_new_tokens=CONT_LEN + 1, do_sample=False)  # min_new_tokens: no EOS stop
            cont = gen[0, len(prompt):].tolist()
            assert len(cont) == CONT_LEN + 1
            full = torch.tensor([prompt + cont[:CONT_LEN]])
            rows = model(full).logits[0, len(prompt) - 1:].float().contiguous()
            assert rows.shape == (CONT_LEN + 1, vocab)
            # generate() is greedy over the same logits, so the continuation is the rows' argmax
            # except at exact ties (none expected with random fp32 weights).
            assert rows.argmax(-1).tolist() == cont, "greedy continuation disagrees with its own logits"
            conts.append(cont)
            logits.append(rows)
    ref = {"name": name, "prompts": prompts, "continuations": conts, "logits": logits, "cont_len": CONT_LEN}
    torch.save(ref, folder / "ref.pt")

    # Cross-check: deepinfer fp32 on CPU, teacher-forced, one batch.
    ours = teacher_forced_logits(folder, prompts, [c[:CONT_LEN] for c in conts], dtype="float32", device="cpu")
    worst = max(((o - r).abs().max() / r.abs().max()).item() for o, r in zip(ours, logits, strict=True))
    assert worst <= 1e-4, f"{name}: deepinfer fp32 CPU differs from transformers by {worst:.2e} of max|logit|"
    margins = torch.cat([r.topk(2, dim=-1).values.diff(dim=-1).neg().squeeze(-1) for r in logits])
    return {"name": name, "bytes": sum(f.stat().st_size for f in folder.iterdir()),
            "max_abs_logit": max(r.abs().max().item() for r in logits),
            "min_margin": margins.min().item(), "cpu_fp32_rel_err": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "gpu_refs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    total = 0
    for name in sorted(TINY):
        info = make_one(name, args.out)
        total += info["bytes"]
        print(f"{name:24s} {info['bytes'] / 1e6:6.2f} MB  max|logit| {info['max_abs_logit']:7.3f}  "
              f"min top-2 margin {info['min_margin']:.4f}  deepinfer fp32 CPU rel err {info['cpu_fp32_rel_err']:.1e}")
    print(f"total {total / 1e6:.2f} MB in {args.out} (prompt lengths {PROMPT_LENGTHS}, {CONT_LEN} forced tokens)")


if __name__ == "__main__":
    main()
