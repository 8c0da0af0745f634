"""KL divergence of the engine's next-token distributions from the oracle's (transformers) over real text
on the real SmolLM2-135M-Instruct.

The text is teacher-forced through the engine (``golden_token_ids``), so every decode step runs the
engine's cached path (paged KV, one token per step) on known tokens, and each step's logits row is
compared with transformers' logits for the same position from one forward over the whole sequence.

Stated bound (float32 on CPU, where both compute in fp32 and differ only in the order of reductions):
the mean KL(p_oracle ‖ p_engine) over positions is below 1e-8 nats and the largest below 1e-6 nats
(measured: mean 3e-11, max 1.4e-10 over 16 positions of the first text).
The greedy-ids tests (tests/test_smollm2.py) check argmax agreement; this checks whole distributions,
so a wrong softmax scale, rope base or norm epsilon that leaves the argmax alone still fails here.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import record_logits

from deepinfer import LLM, SamplingParams

MEAN_KL_BOUND = 1e-8
MAX_KL_BOUND = 1e-6

TEXTS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the lamp room he could see "
    "the fishing boats returning to the harbour, their sails patched and grey, and the gulls circling above "
    "the market where the day's catch was sold.",
    "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is split and oxygen "
    "is released, while carbon dioxide is fixed into sugars through the Calvin cycle. The rate depends on light "
    "intensity, temperature and the concentration of carbon dioxide in the air around the leaf.",
]


def kl_per_position(oracle_logits: torch.Tensor, engine_logits: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(oracle) ‖ softmax(engine))`` per row, in float64 nats."""
    log_p = torch.log_softmax(oracle_logits.double(), dim=-1)
    log_q = torch.log_softmax(engine_logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


@pytest.fixture(scope="module")
def oracle(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def _engine_vs_oracle(llm: LLM, oracle, text: str, prompt_len: int) -> torch.Tensor:
    """KL per position of ``text``'s tokens after the first ``prompt_len`` (negative: all but the last
    ``-prompt_len``), decoded one step at a time under teacher forcing."""
    ids = llm.tokenizer.encode(text)
    prompt_len = prompt_len if prompt_len > 0 else len(ids) + prompt_len
    prompt, golden = ids[:prompt_len], ids[prompt_len:]
    steps = record_logits(llm)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=len(golden), ignore_eos=True,
                                                golden_token_ids=golden), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == golden
    ours = torch.stack([row for rids, logits in steps for rid, row in zip(rids, logits, strict=True)
                        if rid == out.request_id])[:len(golden)]
    with torch.no_grad():
        ref = oracle(torch.tensor([ids])).logits[0, prompt_len - 1:len(ids) - 1]
    return kl_per_position(ref, ours)


def test_engine_logits_match_the_oracle_in_kl(smollm2_dir, oracle):
    llm = LLM(smollm2_dir, kv_cache_bytes=1 << 26, max_model_len=512, block_size=16)
    kl = _engine_vs_oracle(llm, oracle, TEXTS[0], prompt_len=-10)  # 10 cached decode steps: quick
    llm.shutdown()
    assert kl.numel() == 10
    assert kl.mean().item() < MEAN_KL_BOUND and kl.max().item() < MAX_KL_BOUND, (kl.mean().item(), kl.max().item())


@pytest.mark.slow
def test_engine_logits_match_the_oracle_in_kl_on_all_texts_with_chunked_prefill(smollm2_dir, oracle):
    """Every text, a long prompt part prefilled in 16-token chunks, then the rest decoded."""
    llm = LLM(smollm2_dir, kv_cache_bytes=1 << 26, max_model_len=512, block_size=16, max_num_batched_tokens=16)
    kls = torch.cat([_engine_vs_oracle(llm, oracle, text, prompt_len=20) for text in TEXTS])
    llm.shutdown()
    assert kls.mean().item() < MEAN_KL_BOUND and kls.max().item() < MAX_KL_BOUND, (kls.mean().item(), kls.max().item())
