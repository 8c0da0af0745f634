"""Offline acceptance of a trained ``dspark`` drafter per reply kind, on held-out replies and on replies
it was trained on (the generalization gap; docs/benchmarks.md, issue 27).

    python scripts/drafter_gap.py --work WORK_DIR --weights W.safetensors [--per-kind 24] [--max-reply 0]

``WORK_DIR`` holds the training run's ``replies-held-out.json`` and ``replies-train.json`` (they carry their
prompts, so a GPU run's folder works here); the replies are teacher-forced through the target on this
machine and replayed with ``DrafterTrainer.evaluate`` (greedy speculative decoding, ``fixed`` plan), as
the manifest's held-out figure is. ``--max-reply N`` cuts replies to their first N tokens (0: whole).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from deepinfer_spec_decode.drafter_training import DrafterTrainer, Recipe, Sequences, manifest_path, teacher_labels
from deepinfer_spec_decode.dspark import build_network, lm_head_of, load_weights, target_layers

from deepinfer import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--weights", required=True, type=Path)
    ap.add_argument("--per-kind", type=int, default=24)
    ap.add_argument("--max-reply", type=int, default=0)
    args = ap.parse_args()
    manifest = json.loads(manifest_path(args.weights).read_text())
    recipe = Recipe(**manifest["recipe"])
    llm = LLM(args.model, kv_cache_bytes=256 << 20, max_model_len=2048)
    target = llm.engine.model
    cfg = recipe.spec_config()
    layers = target_layers(cfg, len(target.layers))
    network = build_network(target, cfg, len(layers), draft_vocab_size=manifest["draft_vocab_size"]).float()
    load_weights(network, args.weights)
    embed = torch.nn.Embedding.from_pretrained(target.embed_tokens.weight.detach().float(), freeze=True)
    trainer = DrafterTrainer(network, embed, lm_head_of(target).float(), target.vocab_size - 1, cfg.max_draft, recipe)
    for split in ("held-out", "train"):
        saved = json.loads((args.work / f"replies-{split}.json").read_text())
        kinds = saved["kinds"][:len(saved["replies"])]
        for kind in sorted(set(kinds)):
            picked = [i for i, k in enumerate(kinds) if k == kind][:args.per_kind]
            replies = [saved["replies"][i][:args.max_reply or None] for i in picked]
            prompts = [saved["prompts"][i] for i in picked]
            seqs = Sequences([p + r for p, r in zip(prompts, replies, strict=True)], [len(p) for p in prompts],
                             [kind] * len(picked))
            result = trainer.evaluate(teacher_labels(llm, seqs, layers, recipe.top_k))
            print(f"{split:9s} {kind:9s} {len(picked):3d} sequences: mean acceptance "
                  f"{result['mean_acceptance_length']:.3f}, by position "
                  f"{' / '.join(f'{x:.2f}' for x in result['acceptance_by_position'])}", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
