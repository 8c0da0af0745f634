"""``huge_pages.py``: the GEMM backends' prepared weights on transparent huge pages. Placed tensors keep
their values, dtype and shape, 64-byte aligned, packed into shared 2 MB-aligned regions (a large one alone);
where the kernel grants huge pages for advised memory the region is backed by them; in the engine every
GEMM weight is placed and greedy tokens equal a run without."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch
from deepinfer_cpu.huge_pages import ALIGN, HUGE_PAGE, HugePageArena, supported
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not supported(), reason="no MADV_HUGEPAGE on this platform")


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return re.search(r"\[(\w+)\]", text).group(1)


def _huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span and int(span.group(1), 16) <= address < int(span.group(2), 16):
            for field in lines[i + 1:]:
                if re.match(r"[0-9a-f]+-[0-9a-f]+ ", field):
                    break
                if field.startswith("AnonHugePages:"):
                    return int(field.split()[1])
    raise AssertionError("address not mapped")


def test_a_refused_advice_still_places_the_tensor(monkeypatch) -> None:
    """A kernel without THP answers MADV_HUGEPAGE with EINVAL: the weights are copied all the same."""
    class Refusing(mmap.mmap):
        def madvise(self, *args: int) -> None:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", Refusing)
    arena = HugePageArena()
    t = torch.randn(100)
    assert torch.equal(arena.place(t), t) and not arena.advised


def test_placed_tensors_keep_their_values_in_aligned_shared_regions() -> None:
    arena = HugePageArena(chunk=8 << 20)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen).bfloat16(),
               torch.randint(-100, 100, (33,), dtype=torch.int8, generator=gen),
               torch.randn(1200, 1000, generator=gen)]  # 4.8 MB: still in the first 8 MB region
    placed = [arena.place(t) for t in tensors]
    for t, p in zip(tensors, placed, strict=True):
        assert p.dtype == t.dtype and p.shape == t.shape and p.is_contiguous() and torch.equal(p, t)
        assert p.data_ptr() % ALIGN == 0 and p.data_ptr() != t.data_ptr()
    starts = [p.data_ptr() for p in placed]
    assert max(starts) - min(starts) < 8 << 20 and starts == sorted(starts)  # one region, in order
    assert arena.placed_bytes == sum(t.numel() * t.element_size() for t in tensors)
    big = arena.place(torch.ones(3 << 20))  # 12 MB: a region of its own
    assert big.data_ptr() % HUGE_PAGE == 0 and bool(big.eq(1).all())
    placed[0].mul_(2)  # writable, and only the copy changes
    assert torch.equal(placed[0], tensors[0] * 2)


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this machine")
def test_a_region_is_backed_by_huge_pages() -> None:
    big = HugePageArena().place(torch.ones(4 * HUGE_PAGE // 4))  # 8 MB, written by the copy
    assert _huge_kb(big.data_ptr()) >= HUGE_PAGE // 1024


def test_the_engine_places_every_gemm_weight_and_tokens_are_unchanged(tmp_path: Path) -> None:
    _, folder = save_tiny("llama", tmp_path)
    prompts = [[5, 6, 7, 8, 9], list(range(30, 52))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for huge in (True, False):
        llm = LLM(folder, block_size=16, kv_cache_bytes=1 << 22,
                  plugins={"cpu": {"enabled": True, "huge_pages": huge}})
        backend, model = llm.engine.runner.backends["linear"], llm.engine.model
        weights = model.gemm_weights()
        if huge:
            assert backend.arena.placed_bytes == sum(w.numel() * w.element_size() for w in weights)
        else:
            assert backend.arena is None
        runs[huge] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert runs[True] == runs[False]
