"""The C heap's trimmer on CPU runs (``deepinfer/engine/heap.py``)."""

from __future__ import annotations

from deepinfer.engine.heap import HeapTrimmer, resident_bytes


class _Process:
    """A resident size the test moves, and a trim that gives back all but ``kept`` bytes of growth."""

    def __init__(self) -> None:
        self.size = 1000
        self.kept = 10
        self.trimmed = 0

    def measure(self) -> int:
        return self.size

    def trim(self, pad: int) -> int:
        assert pad == 0
        self.trimmed += 1
        self.size = 1000 + self.kept
        return 1


def test_the_heap_is_trimmed_once_it_grew_past_the_size_after_the_last_trim():
    process = _Process()
    heap = HeapTrimmer(growth=100, check_every=4, trim=process.trim, measure=process.measure)
    assert heap.floor == 1000
    process.size = 1150
    for _ in range(3):  # read every fourth step only
        heap.after_step(drained=False)
    assert process.trimmed == 0
    heap.after_step(drained=False)
    assert process.trimmed == 1 and heap.trims == 1 and heap.floor == 1010  # the size after the trim
    process.size = 1100  # grew 90 past it: not yet
    heap.after_step(drained=True)
    assert process.trimmed == 1
    process.size = 1200
    heap.after_step(drained=True)  # a drained engine is looked at whatever the step count
    assert process.trimmed == 2


def test_without_malloc_trim_or_a_resident_size_nothing_is_done():
    process = _Process()
    unmeasured = HeapTrimmer(growth=1, check_every=1, trim=process.trim, measure=lambda: None)
    unmeasured.after_step(drained=True)
    assert process.trimmed == 0 and unmeasured.trims == 0


def test_a_cpu_engine_reports_its_trims(make_llm):
    llm = make_llm()
    assert resident_bytes() > 0  # Linux: the trimmer is active on this machine
    llm.generate([[5, 6, 7]], use_tqdm=False)
    assert llm.engine.heap is not None and llm.get_stats()["heap_trims"] == llm.engine.heap.trims
