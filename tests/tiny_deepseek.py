"""A tiny random DeepSeek-V3 saved as an HF folder, for the expert-parallel tests (2 MoE layers of 8
routed experts, top-2 over 2 groups, one shared expert; no tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from tiny_models import randomize

VOCAB = 256
TINY_V3 = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
           "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
           "qk_nope_head_dim": 16, "v_head_dim": 16, "max_position_embeddings": 256,
           "num_nextn_predict_layers": 0, "bos_token_id": 1, "eos_token_id": 2}


def save_tiny_v3(folder: Path, seed: int = 0, **config: Any) -> Path:
    """Random weights (``tiny_models.randomize``) and a random ``e_score_correction_bias``; ``config``
    overrides fields of ``TINY_V3`` (e.g. ``vocab_size``)."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**TINY_V3, **config})).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    randomize(model, gen)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    model.save_pretrained(folder)
    return folder


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of token ids in ``[3, VOCAB)`` (no special ids) of the given lengths, seeded."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
