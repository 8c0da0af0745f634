"""``deepinfer bench --baseline llama.cpp``'s glue, against a stand-in ``llama_cpp`` module: the peer script
runs in another interpreter, requests continuously batched in slots, greedy, every token stamped; the float32
and bfloat16 copies are made once through the library's quantize call; a missing or unusable peer is a clear
error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from peer_fakes import assert_a_missing_peer_is_a_clear_error, fake_continuation, python_with

from deepinfer.bench.llama_cpp import peer_python, run_llama_cpp

FAKE = '''
import ctypes
__version__ = "0.0-fake"
LLAMA_FTYPE_ALL_F32 = 0
LLAMA_FTYPE_MOSTLY_BF16 = 32
VOCAB = 50000
LOG = []  # the sequence ids of each decode, for the test's bound on slots


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


def llama_backend_init():
    pass


def llama_model_default_params():
    return _Params()


def llama_model_load_from_file(path, params):
    # a copy's "weights" shift every token: the f32 copy by 1000, the bf16 copy by 2000
    return {"shift": 1000 if path.endswith(b".f32.gguf") else 2000 if path.endswith(b".bf16.gguf") else 0}


def llama_context_default_params():
    return _Params()


class _Context:
    def __init__(self, model, params):
        self.shift, self.params = model["shift"], params
        self.history = {}  # sequence id -> the tokens at positions 0, 1, ...
        self.logits = {}


def llama_init_from_model(model, params):
    assert params.n_ubatch <= params.n_batch and params.n_seq_max >= 1
    return _Context(model, params)


def llama_get_memory(context):
    return context


def llama_model_get_vocab(model):
    return model


def llama_vocab_n_tokens(vocab):
    return VOCAB


class _Batch:
    def __init__(self, size):
        self.n_tokens = 0
        self.token, self.pos, self.n_seq_id, self.logits = [0] * size, [0] * size, [0] * size, [0] * size
        self.seq_id = [[0] for _ in range(size)]


def llama_batch_init(size, embd, n_seq_max):
    assert embd == 0 and n_seq_max == 1
    return _Batch(size)


def llama_decode(context, batch):
    """Each row extends its sequence at the next position; a row with logits peaks at a hash of the
    sequence's whole history (so a slot that kept another request's entries gives other tokens)."""
    assert 0 < batch.n_tokens <= context.params.n_batch
    LOG.append({batch.seq_id[row][0] for row in range(batch.n_tokens)})
    assert len(LOG[-1]) <= context.params.n_seq_max
    context.logits = {}
    for row in range(batch.n_tokens):
        assert batch.n_seq_id[row] == 1
        seq = context.history.setdefault(batch.seq_id[row][0], [])
        assert batch.pos[row] == len(seq), "positions must continue the sequence"
        seq.append(batch.token[row])
        if batch.logits[row]:
            values = (ctypes.c_float * VOCAB)()
            values[(sum(seq) * 7 + 3 + context.shift) % VOCAB] = 1.0
            context.logits[row] = values
    return 0


def llama_get_logits_ith(context, row):
    return ctypes.cast(context.logits[row], ctypes.POINTER(ctypes.c_float))


def llama_memory_seq_rm(memory, seq, p0, p1):
    assert p0 == -1 and p1 == -1
    memory.history.pop(seq, None)
    return True
'''


def _fake_python(tmp_path: Path, module: str = FAKE) -> str:
    """A python that imports ``module`` (default: the stand-in above) as ``llama_cpp``."""
    return python_with(tmp_path, {"llama_cpp.py": module})


@pytest.mark.parametrize("slots", [1, 2, 8])
def test_the_peer_batches_requests_in_slots_and_stamps_every_token(tmp_path: Path, slots: int) -> None:
    python = peer_python(_fake_python(tmp_path))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    work = [([5, 9, 11], 4), ([7], 2), ([1, 2], 5), ([8, 8, 8], 1), ([3] * 2100, 3)]
    run, ids = run_llama_cpp(python, gguf, work, threads=1, n_ctx=2200, dtype="q4_1", slots=slots, offline=True)
    # each request's tokens are its own continuation, whatever shared its steps
    assert ids == [fake_continuation(p, m) for p, m in work]
    assert run["engine"] == "llama.cpp 0.0-fake" and run["batch_size"] == slots and run["gguf"] == str(gguf)
    records = run["_records"]
    assert [r.num_output_tokens for r in records] == [4, 2, 5, 1, 3]
    assert all(r.start <= r.chunk_times[0] and r.chunk_times == sorted(r.chunk_times) for r in records)
    assert len({r.start for r in records}) == 1  # offline: every request starts at the run's start
    assert run["output_throughput"] > 0
    firsts = [r.chunk_times[0] for r in records]
    # slots share steps: with room for all, the short prompts' first tokens come from the first step together,
    # and the long prompt, past one step's 2,048 tokens, from the second
    assert (firsts[0] == firsts[1] == firsts[2] == firsts[3]) == (slots == 8)
    assert (firsts[4] > firsts[3]) and (slots < 8 or records[0].chunk_times[1] == firsts[4])

    f32, f32_ids = run_llama_cpp(python, gguf, work, threads=1, n_ctx=2200, dtype="float32", slots=slots,
                                 offline=False)
    copy = tmp_path / "model.f32.gguf"
    assert f32["gguf"] == str(copy) and copy.read_bytes() == b"GGUFf32"
    assert f32_ids == [fake_continuation(p, m, 1000) for p, m in work]
    starts = [r.start for r in f32["_records"]]
    assert len(set(starts)) == 5  # concurrency mode: each request's own start, when it takes a slot
    if slots == 1:  # one at a time: a request starts after the one before has its last token
        assert all(s >= r.chunk_times[-1] for s, r in zip(starts[1:], f32["_records"], strict=False))
    bf16, bf16_ids = run_llama_cpp(python, gguf, work, threads=1, n_ctx=2200, dtype="bfloat16", slots=slots,
                                   offline=True)
    assert bf16["gguf"] == str(tmp_path / "model.bf16.gguf")
    assert bf16_ids == [fake_continuation(p, m, 2000) for p, m in work]


def test_a_missing_or_unusable_peer_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_a_missing_peer_is_a_clear_error(peer_python, "DEEPINFER_LLAMA_CPP_PYTHON", "llama_cpp", monkeypatch)
    monkeypatch.setenv("DEEPINFER_LLAMA_CPP_PYTHON", _fake_python(tmp_path))
    assert os.path.exists(peer_python(None))
    with pytest.raises(ValueError, match="q4_1, float32, bfloat16"):
        run_llama_cpp(sys.executable, tmp_path / "x.gguf", [], threads=1, n_ctx=8, dtype="bf16", slots=1, offline=True)
    with pytest.raises(ValueError, match="at least one slot"):
        run_llama_cpp(sys.executable, tmp_path / "x.gguf", [], threads=1, n_ctx=8, dtype="q4_1", slots=0, offline=True)


@pytest.mark.parametrize("death", ["raise", "signal"])
def test_a_failing_peer_names_its_error_and_not_only_its_log(tmp_path: Path, death: str) -> None:
    """The peer's Python error is reported even when llama.cpp's log lines follow it, and a crash names its
    signal (a llama.cpp build crashed with SIGSEGV on a Q4_1 model and the message showed a log line only)."""
    if death == "raise":  # llama.cpp's log lines after the traceback, as its C logger flushes at exit
        body = ('import atexit, sys\n'
                'atexit.register(lambda: sys.stderr.write("llama_graph_n_input_tensors: inp_pos\\n" * 50))\n'
                'raise ValueError("the model has no tokenizer")\n')
    else:
        body = ('import os, signal, sys\nsys.stderr.write("sched_reserve: graph\\n")\n'
                'os.kill(os.getpid(), signal.SIGSEGV)\n')
    python = _fake_python(tmp_path, body)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError) as failed:
        run_llama_cpp(python, gguf, [([5, 9], 2)], threads=1, n_ctx=64, dtype="q4_1", slots=1, offline=True)
    message = str(failed.value)
    if death == "raise":
        assert "ValueError: the model has no tokenizer" in message and "inp_pos" not in message
    else:
        assert "killed by signal 11" in message
