"""The transformers baseline (``deepinfer bench --baseline transformers``).

The same token-id workload through ``transformers``' ``generate``: static batches (``batch_size``
requests at a time, in workload order), left-padded, greedy, each batch generating until its longest
request is done (EOS suppressed with ``min_new_tokens``); only the tokens a request asked for are
counted. A streamer stamps every generated step, so TTFT/TPOT/ITL/E2EL are measured the same way as
for the engine: in offline mode every request starts at the run's start (queueing counts, as for the
engine), in concurrency mode a request starts when its batch starts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from deepinfer.bench.metrics import RequestRecord, compute_metrics, latency_samples, output_digest

Work = list[tuple[list[int], int]]


class _StepClock:
    """A ``transformers`` streamer that only records when each put arrives (the first is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        """Nothing to flush: the times are recorded as tokens arrive."""


def load_transformers(model_path: str | Path, device: str = "cpu", dtype: str = "float32") -> Any:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype))
    return model.to(device).eval()


def run_transformers(model: Any, work: Work, *, batch_size: int, offline: bool, pad_token_id: int = 0,
                     progress: bool = True, desc: str = "transformers") -> tuple[dict[str, Any], list[list[int]]]:
    """Run ``work`` through ``model.generate`` in static batches; returns (run, output ids)."""
    import torch

    if batch_size < 1:
        raise ValueError("the baseline batch size must be at least 1")
    device = next(model.parameters()).device
    records: list[RequestRecord] = []
    outputs: list[list[int]] = []
    with tqdm(total=len(work), desc=desc, unit="req", disable=not progress, leave=False) as bar:
        t0 = time.perf_counter()
        for i in range(0, len(work), batch_size):
            chunk = work[i:i + batch_size]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p, _ in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
            longest = max(m for _, m in chunk)
            clock = _StepClock()
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                     do_sample=False, pad_token_id=pad_token_id, streamer=clock)
            done = time.perf_counter()
            # One stamp per generated step after the prompt's; if the streamer lagged, fill with the end.
            steps = (clock.times[1:] + [done] * longest)[:longest]
            new = out[:, width:].tolist()
            for (prompt, m), row in zip(chunk, new, strict=True):
                records.append(RequestRecord(prompt_len=len(prompt), start=t0 if offline else start,
                                             chunk_times=steps[:m], chunk_tokens=[1] * m,
                                             output_token_ids=row[:m]))
                outputs.append(row[:m])
            bar.update(len(chunk))
        end = time.perf_counter()
    run = peer_run("transformers", records, outputs, end - t0, offline=offline, batch_size=batch_size)
    run["samples"].pop("itl_ms")
    return run, outputs


def peer_run(engine: str, records: list[RequestRecord], outputs: list[list[int]], seconds: float, *,
             offline: bool, batch_size: int, **extra: Any) -> dict[str, Any]:
    """A baseline's run record, as the engine's (``engine`` names the peer; ``extra`` adds fields)."""
    return {"engine": engine, "mode": "offline" if offline else "concurrency",
            "concurrency": None if offline else batch_size, "batch_size": batch_size, **extra,
            **compute_metrics(records, seconds), "output_digest": output_digest(outputs),
            "samples": latency_samples(records), "_records": records}


def token_match(a: list[list[int]], b: list[list[int]]) -> float:
    """The fraction of requests whose output ids are identical."""
    if not a:
        return 1.0
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
