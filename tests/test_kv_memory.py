"""``kv/memory.py``: a large CPU cache is zeros everywhere, takes resident memory only where written, and
lives as long as its tensor; an engine's default 2 GiB CPU budget no longer becomes 2 GiB resident."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams
from deepinfer.kv.memory import LAZY_MIN_BYTES, cache_zeros


def _resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    pytest.skip("no /proc/self/status")


def test_a_large_cpu_cache_is_zeros_and_resident_only_where_written() -> None:
    before = _resident_mb()
    cache = cache_zeros((2048, 16, 8, 128), torch.bfloat16, "cpu")  # 64 MiB
    assert cache.shape == (2048, 16, 8, 128) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert _resident_mb() - before < 8
    view = cache[3:5]
    view.fill_(1.5)
    del cache
    gc.collect()
    assert view.sum().item() == 1.5 * view.numel()  # the mapping lives on with a view of it
    fresh = cache_zeros((1 << 22,), torch.float32, torch.device("cpu"))
    assert not fresh.any()
    small = cache_zeros((LAZY_MIN_BYTES // 8,), torch.float32, "cpu")
    assert not small.any() and small.numel() * 4 < LAZY_MIN_BYTES


def test_an_engine_with_the_default_cpu_budget_stays_small(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path)[1]
    before = _resident_mb()
    llm = LLM(folder, block_size=16)  # the CPU default: 2 GiB of KV
    stats = llm.get_stats()
    assert stats["kv_blocks_total"] * 16 > 1_000_000  # a budget far above what the test touches
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert _resident_mb() - before < 300
    llm.shutdown()
