"""Benchmarking a running server over HTTP (``deepinfer bench --url``).

Requests go to ``/v1/completions`` with token-id prompts, ``stream: true``, ``logprobs: 0`` (so every
server-sent chunk says how many tokens it carries) and ``ignore_eos``, so each request produces
exactly its output length, as in the offline runs. Arrivals follow a Poisson process at the given
request rate (seeded), or all at once for ``inf``; timestamps are taken when each chunk arrives, and
the metrics are the offline runner's (``bench/metrics.py``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from deepinfer.bench.metrics import RequestRecord, compute_metrics, latency_samples

Work = list[tuple[list[int], int]]


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,inf"`` → [0.5, 1.0, inf]."""
    rates = []
    for item in text.split(","):
        value = float(item.strip())
        if not value > 0:
            raise ValueError(f"--request-rate {text!r}: rates must be > 0 (or inf)")
        rates.append(value)
    return rates


async def _one(client: Any, url: str, body: dict[str, Any], rec: RequestRecord) -> bool:
    rec.start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            choices = json.loads(data).get("choices") or []
            if not choices:
                continue
            logprobs = choices[0].get("logprobs") or {}
            count = len(logprobs.get("tokens") or [])
            if count:
                rec.chunk_times.append(time.perf_counter())
                rec.chunk_tokens.append(count)
    return True


async def _run(url: str, model: str, work: Work, rate: float, seed: int, api_key: str | None,
               timeout: float) -> tuple[list[RequestRecord], int, float]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    records = [RequestRecord(prompt_len=len(p), start=0.0) for p, _ in work]
    limits = httpx.Limits(max_connections=len(work) + 1, max_keepalive_connections=len(work) + 1)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for (prompt, max_tokens), rec in zip(work, records, strict=True):
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "logprobs": 0}
            tasks.append(asyncio.create_task(_one(client, url, body, rec)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        end = time.perf_counter()
    return records, sum(1 for ok in results if not ok), end - t0


def run_http(url: str, model: str, work: Work, *, rate: float, seed: int = 0, api_key: str | None = None,
             timeout: float = 600.0) -> dict[str, Any]:
    """One run against a server; the run object of ``docs/bench.md`` with ``engine: "http"``."""
    records, failed, duration = asyncio.run(_run(url.rstrip("/"), model, work, rate, seed, api_key, timeout))
    done = [r for r in records if r.chunk_times]
    run: dict[str, Any] = {
        "engine": "http",
        "mode": "request_rate",
        "concurrency": None,
        "request_rate": rate if rate != float("inf") else "inf",
        **compute_metrics(done, duration),
        "failed_requests": failed + len(records) - len(done),
        "samples": latency_samples(done),
    }
    run["samples"].pop("itl_ms")
    return run
