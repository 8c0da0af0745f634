"""The llama.cpp side of ``deepinfer bench --baseline llama.cpp``: a script the *peer's* interpreter runs.

It imports nothing of deepinfer (the peer lives in its own environment: ``pip install llama-cpp-python``
there) and talks through two JSON files::

    <peer python> -c "$(cat llama_cpp_peer.py)" IN.json OUT.json

``IN``: ``{"gguf": path, "work": [[prompt ids, new tokens], ...], "threads": n, "n_ctx": n,
"dtype": "q4_1" | "float32" | "bfloat16", "slots": n, "offline": bool}``. With ``float32`` (``bfloat16``) the
GGUF's tensors are first written out as float32 (bfloat16) by llama.cpp's own ``llama_model_quantize``,
requantizing allowed, into ``<gguf stem>.f32.gguf`` (``.bf16.gguf``) beside it, once: the same dequantized
weights deepinfer runs in that dtype (bf16: the float32 values rounded to nearest even, as torch rounds them).

The requests run as ``llama-server`` runs its parallel slots, on the library's low-level API: ``slots``
sequences in one context (``n_seq_max``, each with a KV buffer of its own of ``n_ctx`` positions: ``kv_unified`` off,
as ``llama-server -np N`` sets it), continuous
batching — every step is one ``llama_decode`` of each generating slot's last token plus as many prompt tokens
of slots still prefilling as fit in the 2,048-token batch (``llama-server``'s ``n_batch``; ``n_ubatch`` 512) —
and a request takes a slot as soon as one frees. Greedy (the logits' argmax), EOS ignored. Each request's
start (the run's start when ``offline``, else when it took its slot), every token's arrival and the tokens go
to ``OUT``: ``{"version": llama_cpp.__version__, "gguf": path run, "requests": [{"start": s, "times": [...],
"tokens": [...]}, ...], "start": t0, "end": t1}`` (seconds of ``time.perf_counter``).
"""

import json
import os
import sys
import time
from collections import deque

COPIES = {"float32": ("f32", "LLAMA_FTYPE_ALL_F32"), "bfloat16": ("bf16", "LLAMA_FTYPE_MOSTLY_BF16")}
BATCH_TOKENS = 2048  # llama-server's default n_batch
MICRO_BATCH_TOKENS = 512  # and n_ubatch


def converted_copy(gguf: str, dtype: str) -> str:
    """The GGUF's tensors in ``dtype`` (a key of ``COPIES``) in a file beside it (made once)."""
    import llama_cpp

    suffix, ftype = COPIES[dtype]
    target = os.path.splitext(gguf)[0] + f".{suffix}.gguf"
    if not os.path.exists(target):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, ftype)
        params.allow_requantize = True
        partial = target + ".partial"
        if llama_cpp.llama_model_quantize(gguf.encode(), partial.encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not write {gguf} as {dtype}")
        os.replace(partial, target)
    return target


class Sequence:
    """One request in a slot: its prompt, how much of it the context holds, its generated tokens."""

    def __init__(self, index: int, prompt: list, new_tokens: int, start: float) -> None:
        self.index, self.prompt, self.new_tokens, self.start = index, prompt, new_tokens, start
        self.fed = 0
        self.tokens: list = []
        self.times: list = []


class Slots:
    """A llama.cpp context with ``slots`` sequences and the batch that feeds it."""

    def __init__(self, gguf: str, *, slots: int, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx * slots
        params.n_batch = BATCH_TOKENS
        params.n_ubatch = MICRO_BATCH_TOKENS
        params.n_seq_max = slots
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False
        self.context = llama_cpp.llama_init_from_model(self.model, params)
        if not self.context:
            raise SystemExit("llama.cpp could not make a context")
        self.memory = llama_cpp.llama_get_memory(self.context)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, 1)
        self.size = slots

    def add(self, token: int, position: int, slot: int, logits: bool) -> int:
        """Append one token to the batch; returns its row."""
        row = self.batch.n_tokens
        self.batch.token[row] = token
        self.batch.pos[row] = position
        self.batch.n_seq_id[row] = 1
        self.batch.seq_id[row][0] = slot
        self.batch.logits[row] = int(logits)
        self.batch.n_tokens = row + 1
        return row

    def decode(self) -> None:
        """Run the batch and empty it."""
        if self.lib.llama_decode(self.context, self.batch) != 0:
            raise SystemExit("llama_decode failed")
        self.batch.n_tokens = 0

    def argmax(self, row: int) -> int:
        """The greedy token of the batch row ``row``."""
        import numpy as np

        logits = self.lib.llama_get_logits_ith(self.context, row)
        return int(np.ctypeslib.as_array(logits, shape=(self.vocab,)).argmax())

    def clear(self, slot: int) -> None:
        """Drop a finished sequence's cache entries."""
        self.lib.llama_memory_seq_rm(self.memory, slot, -1, -1)


def step(engine: Slots, active: dict) -> None:
    """One ``llama_decode``: every generating slot's last token, then prompt tokens up to the batch's size."""
    rows = {}
    for slot, seq in active.items():
        if seq.fed == len(seq.prompt):
            rows[slot] = engine.add(seq.tokens[-1], len(seq.prompt) + len(seq.tokens) - 1, slot, True)
    room = BATCH_TOKENS - len(rows)
    for slot, seq in active.items():
        if seq.fed == len(seq.prompt) or room == 0:
            continue
        take = min(room, len(seq.prompt) - seq.fed)
        for position in range(seq.fed, seq.fed + take):
            row = engine.add(seq.prompt[position], position, slot, position == len(seq.prompt) - 1)
        seq.fed += take
        room -= take
        if seq.fed == len(seq.prompt):
            rows[slot] = row
    engine.decode()
    for slot, row in rows.items():
        active[slot].tokens.append(engine.argmax(row))
    now = time.perf_counter()  # one stamp per step, as the engine's
    for slot in rows:
        active[slot].times.append(now)


def serve(engine: Slots, work: list, *, offline: bool) -> tuple[list, float, float]:
    """Run every request through the slots; returns (per-request records in order, start, end)."""
    pending = deque(enumerate(work))
    free = list(range(engine.size))[::-1]
    active: dict = {}
    records: list = [None] * len(work)
    t0 = time.perf_counter()
    while pending or active:
        while free and pending:
            index, (prompt, new_tokens) = pending.popleft()
            active[free.pop()] = Sequence(index, prompt, new_tokens, t0 if offline else time.perf_counter())
        step(engine, active)
        for slot in [s for s, seq in active.items() if len(seq.tokens) == seq.new_tokens]:
            seq = active.pop(slot)
            engine.clear(slot)
            free.append(slot)
            records[seq.index] = {"start": seq.start, "times": seq.times, "tokens": seq.tokens}
    return records, t0, time.perf_counter()


def main(source: str, destination: str) -> None:
    import llama_cpp

    with open(source) as fh:
        spec = json.load(fh)
    gguf = converted_copy(spec["gguf"], spec["dtype"]) if spec.get("dtype") in COPIES else spec["gguf"]
    engine = Slots(gguf, slots=spec["slots"], n_ctx=spec["n_ctx"], threads=spec["threads"])
    if spec["work"]:  # a short untimed run: first-call costs out of the timings
        serve(engine, [(spec["work"][0][0][:8], 4)], offline=True)
    requests, start, end = serve(engine, [(p, n) for p, n in spec["work"]], offline=spec["offline"])
    with open(destination, "w") as fh:
        json.dump({"version": llama_cpp.__version__, "gguf": gguf, "requests": requests, "start": start,
                   "end": end}, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
