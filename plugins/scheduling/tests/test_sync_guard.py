"""The sync guard's arbitration between launch scopes and read scopes (the CUDA side runs in
test_overlap_gpu.py; here torch's process-wide mode is replaced by a recorder)."""

from __future__ import annotations

import threading

import pytest
import torch
from deepinfer_scheduling.sync_guard import SyncGuard
from tiny_models import save_tiny

from deepinfer import LLM, SamplingParams


@pytest.fixture
def mode(monkeypatch):
    """torch's sync debug mode as a recorded value (0 default, 2 error), with CUDA pretended."""
    state = {"mode": 0, "changes": []}

    def set_mode(value):
        state["mode"] = {"default": 0, "warn": 1, "error": 2}.get(value, value)
        state["changes"].append(state["mode"])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: state["mode"])
    return state


def test_launches_enforce_reads_pause_and_the_old_mode_comes_back(mode):
    guard = SyncGuard(enabled=True)
    mode["mode"] = 1  # the user's own setting ("warn") before the guard
    with guard.launching():
        assert mode["mode"] == 2
        with guard.launching():  # the host's launch beside the device thread's
            assert mode["mode"] == 2
        assert mode["mode"] == 2
        with guard.reading():  # the host reads step N while N+1 launches
            assert mode["mode"] == 1
        assert mode["mode"] == 2
    assert mode["mode"] == 1
    with guard.reading():
        assert mode["mode"] == 1
    with pytest.raises(ValueError), guard.launching():
        raise ValueError("a failing launch still restores the mode")
    assert mode["mode"] == 1 and mode["changes"] == [2, 1, 2, 1, 2, 1]


def test_scopes_on_two_threads_balance(mode):
    guard = SyncGuard(enabled=True)
    barrier = threading.Barrier(2)

    def launches():
        with guard.launching():
            barrier.wait()  # the reader starts while a launch runs
            for _ in range(200):
                with guard.launching():
                    pass

    def reads():
        barrier.wait()
        for _ in range(200):
            with guard.reading():
                pass

    threads = [threading.Thread(target=launches), threading.Thread(target=reads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mode["mode"] == 0


def test_a_disabled_guard_never_touches_the_mode(mode):
    guard = SyncGuard(enabled=False)
    with guard.launching(), guard.reading():
        pass
    assert mode["changes"] == []


def test_the_config_field_reaches_the_executor(tmp_path):
    """Without CUDA the guard is off whatever the config says, and the run is unchanged."""
    folder = save_tiny("llama", tmp_path)[1]
    llm = LLM(folder, block_size=16, kv_cache_bytes=1 << 20,
              plugins={"scheduling": {"enabled": True, "sync_guard": True}}, scheduler={"executor": "overlap"})
    assert llm.engine.executor.guard.enabled == torch.cuda.is_available()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
