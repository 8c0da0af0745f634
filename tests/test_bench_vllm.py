"""``deepinfer bench --baseline vllm``'s glue, against a stand-in ``vllm`` package: the peer script runs in
another interpreter, in-process engine, at most ``slots`` requests unfinished, greedy on the given token ids,
every step's tokens stamped; a missing or unusable peer, a bad dtype and a failing peer are clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from peer_fakes import assert_a_missing_peer_is_a_clear_error, fake_continuation, python_with

from deepinfer.bench.vllm_baseline import peer_python, run_vllm
from deepinfer.entrypoints.cli import main

FAKE_INIT = '''
import os

__version__ = "0.0-fake"
SHIFT = {"float32": 0, "bfloat16": 5000}
IN_FLIGHT = []  # requests unfinished at each step, for the test's bound


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos, detokenize, output_kind):
        assert temperature == 0.0 and ignore_eos and not detokenize and output_kind == "delta"
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, request_id, token_ids, finished):
        self.request_id, self.outputs, self.finished = request_id, [_Completion(token_ids)], finished


class _Engine:
    """One token per unfinished request per step (at most max_num_seqs of them run): a hash of its history."""

    def __init__(self, shift, max_num_seqs):
        self.shift, self.max_num_seqs, self.requests = shift, max_num_seqs, {}

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = [list(prompt["prompt_token_ids"]), params.max_tokens, 0]

    def step(self):
        IN_FLIGHT.append(len(self.requests))
        assert len(self.requests) <= self.max_num_seqs
        outputs = []
        for request_id in list(self.requests):
            history, wanted, made = self.requests[request_id]
            token = (sum(history) * 7 + 3 + self.shift) % 50000
            history.append(token)
            self.requests[request_id][2] = made + 1
            finished = made + 1 == wanted
            if finished:
                del self.requests[request_id]
            outputs.append(_Output(request_id, [token], finished))
        return outputs


class LLM:
    def __init__(self, model, dtype, max_num_seqs, max_model_len, skip_tokenizer_init, seed):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["VLLM_CPU_KVCACHE_SPACE"]
        assert os.path.isdir(model) and skip_tokenizer_init and max_model_len > 0
        self.llm_engine = _Engine(SHIFT[dtype], max_num_seqs)
'''
FAKE_SAMPLING = 'class RequestOutputKind:\n    DELTA = "delta"\n'


def _fake_python(tmp_path: Path, init: str = FAKE_INIT) -> str:
    """A python that imports ``init`` (default: the stand-in above) as ``vllm``."""
    return python_with(tmp_path, {"vllm/__init__.py": init, "vllm/sampling_params.py": FAKE_SAMPLING})


@pytest.mark.parametrize("slots", [1, 2, 8])
def test_the_peer_keeps_slots_in_flight_and_stamps_every_token(tmp_path: Path, slots: int) -> None:
    python = peer_python(_fake_python(tmp_path))
    work = [([5, 9, 11], 4), ([7], 2), ([1, 2], 5), ([8, 8, 8], 1), ([3] * 40, 3)]
    run, ids = run_vllm(python, tmp_path, work, dtype="float32", slots=slots, offline=True, max_model_len=64,
                        threads=1)
    assert ids == [fake_continuation(p, m) for p, m in work]
    assert run["engine"] == "vllm 0.0-fake" and run["batch_size"] == slots and run["baseline_dtype"] == "float32"
    records = run["_records"]
    assert [r.num_output_tokens for r in records] == [4, 2, 5, 1, 3]
    assert all(r.start <= r.chunk_times[0] and r.chunk_times == sorted(r.chunk_times) for r in records)
    assert len({r.start for r in records}) == 1  # offline: every request starts at the run's start
    firsts = [r.chunk_times[0] for r in records]
    assert (len(set(firsts)) == 1) == (slots == 8)  # with room for all, one step answers every first token
    bf16, bf16_ids = run_vllm(python, tmp_path, work, dtype="bfloat16", slots=slots, offline=False, max_model_len=64,
                              threads=1)
    assert bf16_ids == [fake_continuation(p, m, 5000) for p, m in work]
    starts = [r.start for r in bf16["_records"]]
    if slots == 1:  # one at a time: a request is added after the one before has its last token
        assert all(s >= r.chunk_times[-1] for s, r in zip(starts[1:], bf16["_records"], strict=False))


def test_a_missing_or_unusable_peer_or_a_bad_dtype_is_a_clear_error(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert_a_missing_peer_is_a_clear_error(peer_python, "DEEPINFER_VLLM_PYTHON", "vllm", monkeypatch)
    with pytest.raises(ValueError, match="float32, bfloat16"):
        run_vllm(sys.executable, tmp_path, [], dtype="q4_1", slots=1, offline=True, max_model_len=8, threads=1)
    with pytest.raises(ValueError, match="at least one request"):
        run_vllm(sys.executable, tmp_path, [], dtype="float32", slots=0, offline=True, max_model_len=8, threads=1)
    python = _fake_python(tmp_path, 'raise ImportError("libtorchcodec_image.so: cannot open shared object")\n')
    with pytest.raises(RuntimeError, match=r"libtorchcodec_image\.so"):
        run_vllm(python, tmp_path, [([5], 2)], dtype="float32", slots=1, offline=True, max_model_len=8, threads=1)


def test_bench_puts_the_vllm_peer_beside_each_point(tiny_llama_dir: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``deepinfer bench --baseline vllm`` runs the peer on the folder the engine loaded, in the engine's dtype,
    one run per concurrency, and reports the throughput ratio and token match."""
    python = _fake_python(tmp_path)
    out = tmp_path / "bench.json"
    main(["bench", "--model", str(tiny_llama_dir), "--num-prompts", "3", "--input-len", "6", "--output-len", "4",
          "--concurrency", "1,2", "--baseline", "vllm", "--baseline-python", python, "--output", str(out),
          "--no-progress", "--set", "model.dtype=float32"])
    report = json.loads(out.read_text())
    assert [row["baseline_batch_size"] for row in report["baseline"]] == [1, 2]
    assert all(row["baseline"] == "vllm 0.0-fake" and row["baseline_dtype"] == "float32"
               and row["output_throughput_ratio"] > 0 and 0 <= row["token_match"] <= 1 for row in report["baseline"])
    assert [run["engine"] for run in report["runs"]].count("vllm 0.0-fake") == 2
