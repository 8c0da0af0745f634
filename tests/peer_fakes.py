"""Stand-in peer environments for the baselines run in an interpreter of their own (``deepinfer/bench/peer_env.py``):
a wrapper interpreter that imports fake modules, and the greedy rule the fakes share."""

from __future__ import annotations

import importlib.util
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


def python_with(tmp_path: Path, files: dict[str, str]) -> str:
    """An interpreter (a shell wrapper around this one) whose path holds ``files`` (relative path → source)."""
    root = tmp_path / "fake"
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    wrapper = tmp_path / "peer-python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={root} exec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def fake_continuation(prompt: list[int], n: int, shift: int = 0) -> list[int]:
    """The fakes' greedy continuation of ``prompt``: each token a hash of the whole history (so a request that sees
    another's entries gives other tokens)."""
    history, out = list(prompt), []
    for _ in range(n):
        out.append((sum(history) * 7 + 3 + shift) % 50000)
        history.append(out[-1])
    return out


def assert_a_missing_peer_is_a_clear_error(peer_python: Callable[[str | None], str], env_var: str, module: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``peer_python`` without an interpreter names ``--baseline-python``; with one that cannot import ``module``
    (this one, where it is not installed: CI's never has a peer) it names the module."""
    monkeypatch.delenv(env_var, raising=False)
    with pytest.raises(ValueError, match="--baseline-python"):
        peer_python(None)
    if importlib.util.find_spec(module) is None:
        with pytest.raises(ValueError, match=f"cannot import {module}"):
            peer_python(sys.executable)
