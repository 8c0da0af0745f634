"""``deepinfer bench --baseline llama.cpp``'s glue, against a stand-in ``llama_cpp`` module: the peer script
runs in another interpreter, requests one at a time, greedy, every token stamped; the float32 and bfloat16
copies are made once through the library's quantize call; a missing or unusable peer is a clear error."""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
from pathlib import Path

import pytest

from deepinfer.bench.llama_cpp import peer_python, run_llama_cpp

FAKE = '''
__version__ = "0.0-fake"
LLAMA_FTYPE_ALL_F32 = 0
LLAMA_FTYPE_MOSTLY_BF16 = 32
class _Params:
    ftype = 7
    allow_requantize = False
def llama_model_quantize_default_params():
    return _Params()
def llama_model_quantize(src, dst, params):
    assert params.allow_requantize
    tag = {LLAMA_FTYPE_ALL_F32: b"f32", LLAMA_FTYPE_MOSTLY_BF16: b"bf16"}[params.ftype]
    open(dst.decode(), "wb").write(open(src.decode(), "rb").read() + tag)
    return 0
class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_batch, verbose):
        self.model_path = model_path
    def reset(self):
        pass
    def generate(self, tokens, top_k, temp, repeat_penalty, reset):
        assert top_k == 1 and temp == 0.0 and repeat_penalty == 1.0
        last = tokens[-1] + (1000 if self.model_path.endswith(".f32.gguf") else 0)
        last += 2000 if self.model_path.endswith(".bf16.gguf") else 0
        while True:  # never stops by itself: the caller takes what it asked for
            last = (last * 7 + 3) % 50000
            yield last
'''


def _fake_python(tmp_path: Path) -> str:
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "llama_cpp.py").write_text(FAKE)
    wrapper = tmp_path / "peer-python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def test_the_peer_runs_each_request_alone_and_stamps_every_token(tmp_path: Path) -> None:
    python = peer_python(_fake_python(tmp_path))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    work = [([5, 9, 11], 4), ([7], 2), ([3, 3], 3)]
    run, ids = run_llama_cpp(python, gguf, work, threads=1, n_ctx=64, dtype="q4_1", offline=True)

    def expected(last: int, n: int) -> list[int]:
        out = []
        for _ in range(n):
            last = (last * 7 + 3) % 50000
            out.append(last)
        return out

    assert ids == [expected(p[-1], m) for p, m in work]
    assert run["engine"] == "llama.cpp 0.0-fake" and run["batch_size"] == 1 and run["gguf"] == str(gguf)
    records = run["_records"]
    assert [r.num_output_tokens for r in records] == [4, 2, 3]
    assert all(r.start <= r.chunk_times[0] and r.chunk_times == sorted(r.chunk_times) for r in records)
    assert len({r.start for r in records}) == 1  # offline: every request starts at the run's start
    assert run["output_throughput"] > 0

    f32, f32_ids = run_llama_cpp(python, gguf, work, threads=1, n_ctx=64, dtype="float32", offline=False)
    copy = tmp_path / "model.f32.gguf"
    assert f32["gguf"] == str(copy) and copy.read_bytes() == b"GGUFf32"
    assert f32_ids == [expected(p[-1] + 1000, m) for p, m in work]
    assert len({r.start for r in f32["_records"]}) == 3  # concurrency mode: each request's own start
    bf16, bf16_ids = run_llama_cpp(python, gguf, work, threads=1, n_ctx=64, dtype="bfloat16", offline=True)
    assert bf16["gguf"] == str(tmp_path / "model.bf16.gguf")
    assert bf16_ids == [expected(p[-1] + 2000, m) for p, m in work]


def test_a_missing_or_unusable_peer_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPINFER_LLAMA_CPP_PYTHON", raising=False)
    with pytest.raises(ValueError, match="--baseline-python"):
        peer_python(None)
    if importlib.util.find_spec("llama_cpp") is None:  # this environment has no llama_cpp (CI's has none)
        with pytest.raises(ValueError, match="cannot import llama_cpp"):
            peer_python(sys.executable)
    monkeypatch.setenv("DEEPINFER_LLAMA_CPP_PYTHON", _fake_python(tmp_path))
    assert os.path.exists(peer_python(None))
    with pytest.raises(ValueError, match="q4_1, float32, bfloat16"):
        run_llama_cpp(sys.executable, tmp_path / "x.gguf", [], threads=1, n_ctx=8, dtype="bf16", offline=True)
