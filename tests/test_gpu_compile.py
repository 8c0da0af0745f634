"""``kernels.compile: inductor`` on the GPU (run on the lent H200: ``pytest -m gpu``): the compiled
layers inside CUDA graphs give the plain layers' greedy tokens and logprobs (fp32, every bucket), on a
tiny Llama and a tiny DeepSeek-V3, also under the overlapped executor and speculative decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_gpu_graphs import BATCHES, PLUGINS, _compare, _llm, _prompts, _run, assert_every_bucket_replays
from tiny_deepseek import save_tiny_v3
from tiny_models import save_tiny

from deepinfer import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        save_tiny("llama", path)
        return path
    return save_tiny_v3(path)


@pytest.mark.parametrize("plugins", [{}, {"scheduling": {"enabled": True}}], ids=["sync", "overlap"])
def test_compiled_graphs_equal_plain_graphs_for_every_bucket(folder: Path, plugins: dict) -> None:
    plain_llm = _llm(folder, graphs=True, plugins=plugins)
    plain = {n: _run(plain_llm, _prompts(n)) for n in BATCHES}
    plain_llm.shutdown()
    assert_every_bucket_replays(_llm(folder, graphs=True, plugins=plugins, kernels={"compile": "inductor"}), plain)


def test_compiled_graphs_under_speculative_decoding(folder: Path) -> None:
    prompts = _prompts(9)
    spec = {"spec_decode": {"enabled": True, "drafter": "ngram", "max_draft": 3}}
    plain_llm = _llm(folder, graphs=True, plugins=spec)
    plain = _run(plain_llm, prompts)
    plain_llm.shutdown()
    llm = _llm(folder, graphs=True, plugins=spec, kernels={"compile": "inductor"})
    _compare(plain, _run(llm, prompts))
    llm.shutdown()


def test_compiled_deepseek_v4_graphs_equal_plain_graphs() -> None:
    """The tiny V4 of the GPU references (sliding, CSA with its indexer, and HCA layers; hyper-connections):
    compiled layers write the compressors' rings and entries in place and run the cell-wise Sinkhorn, and
    their graphs give the plain graphs' greedy tokens and logprobs at every bucket."""
    folder = Path(__file__).parent / "gpu_refs_deepseek_v4" / "v4-gpu"
    batches = (1, 2, 3, 5, 8)
    prompts = {n: _prompts(n) for n in batches}

    def run(**kernels: object) -> dict[int, list]:
        llm = LLM(folder, device="cuda", dtype="float32", kv_cache_bytes=1 << 26, block_size=16, max_num_seqs=8,
                  plugins=PLUGINS, kernels={"cuda_graphs": True, **kernels})
        try:
            out = {n: _run(llm, prompts[n]) for n in batches}
            stats = llm.get_stats()
            assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
            return out
        finally:
            llm.shutdown()

    plain = run()
    compiled = run(compile="inductor")
    for n in batches:
        _compare(plain[n], compiled[n])
