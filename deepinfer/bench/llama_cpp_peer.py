"""The llama.cpp side of ``deepinfer bench --baseline llama.cpp``: a script the *peer's* interpreter runs.

It imports nothing of deepinfer (the peer lives in its own environment: ``pip install llama-cpp-python``
there) and talks through two JSON files::

    <peer python> -c "$(cat llama_cpp_peer.py)" IN.json OUT.json

``IN``: ``{"gguf": path, "work": [[prompt ids, new tokens], ...], "threads": n, "n_ctx": n,
"dtype": "q4_1" | "float32" | "bfloat16"}``. With ``float32`` (``bfloat16``) the GGUF's tensors are first
written out as float32 (bfloat16) by llama.cpp's own ``llama_model_quantize``, requantizing allowed, into
``<gguf stem>.f32.gguf`` (``.bf16.gguf``) beside it, once: the same dequantized weights deepinfer runs in
that dtype (bf16: the float32 values rounded to nearest even, as torch rounds them). Each request then
runs alone (the library's ``Llama.generate``: one sequence at a time), greedy, EOS ignored, and its start,
every token's arrival and the tokens go to ``OUT``: ``{"version": llama_cpp.__version__, "gguf": path run,
"requests": [{"start": s, "times": [...], "tokens": [...]}, ...], "start": t0, "end": t1}`` (seconds of
``time.perf_counter``).
"""

import json
import os
import sys
import time

COPIES = {"float32": ("f32", "LLAMA_FTYPE_ALL_F32"), "bfloat16": ("bf16", "LLAMA_FTYPE_MOSTLY_BF16")}


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


def main(source: str, destination: str) -> None:
    import llama_cpp

    with open(source) as fh:
        spec = json.load(fh)
    gguf = converted_copy(spec["gguf"], spec["dtype"]) if spec.get("dtype") in COPIES else spec["gguf"]
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=spec["n_ctx"], n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], n_batch=512, verbose=False)
    warm = spec["work"][0][0][:8]  # a short untimed run: first-call costs out of the timings
    for n, _ in enumerate(llm.generate(warm, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)):
        if n == 3:
            break
    requests = []
    t0 = time.perf_counter()
    for prompt, new_tokens in spec["work"]:
        llm.reset()
        start, times, tokens = time.perf_counter(), [], []
        for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        requests.append({"start": start, "times": times, "tokens": tokens})
    end = time.perf_counter()
    with open(destination, "w") as fh:
        json.dump({"version": llama_cpp.__version__, "gguf": gguf, "requests": requests, "start": t0, "end": end}, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
