"""Fixtures shared by the attention plugin's tests: the tiny random models the engine-level tests run
(built once per test module, like the fixtures they replace)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (GQA attention; ``tests/tiny_models.py``)."""
    from tiny_models import save_tiny

    return save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))[1]


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DeepSeek-V3 (MLA attention, MoE; ``tests/tiny_deepseek.py``)."""
    from tiny_deepseek import save_tiny_v3

    return save_tiny_v3(tmp_path_factory.mktemp("tiny-v3"))
