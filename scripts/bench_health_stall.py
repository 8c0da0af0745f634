"""``/health`` latency while a client tries to stall the server's event loop (issue 24, docs/benchmarks.md).

Starts the server in-process (uvicorn on a loopback port, SmolLM2-135M-Instruct on CPU), polls ``/health``
every 20 ms from a separate process while one scenario runs, and prints one JSON line per scenario: the
poll latencies' median and maximum (ms), the scenario's wall time and the HTTP status it got.

- ``idle``: nothing else runs.
- ``stops-10000``: a streaming completion with 10,000 stop strings (the server now answers 400).
- ``stream``: a streaming completion of 64 tokens, no stop strings (the reference for the next one).
- ``stops-max``: the same with the most stop strings the server takes (64 of 512 characters).
- ``prompt-1mb``: a completion whose text prompt is ~1 MB (tokenized, then refused as too long).
- ``slow-bodies``: 50 clients that send their headers and trickle their bodies.

    python scripts/bench_health_stall.py              # all scenarios
    python scripts/bench_health_stall.py --scenarios idle prompt-1mb

Runs against whatever ``deepinfer`` is on the path, so the same command measures an older checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import uvicorn

from deepinfer.entrypoints.async_llm import AsyncLLM
from deepinfer.server.app import create_app

NAME = "smollm2"


def _post(base: str, payload: dict[str, Any], timeout: float = 300) -> int:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def _stops(n: int, length: int) -> list[str]:
    return [f"never{i:05d}" + "q" * max(0, length - 10) for i in range(n)]


def _slow_bodies(base: str, port: int, clients: int = 50, seconds: float = 5.0) -> int:
    socks = []
    for _ in range(clients):
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n{")
        socks.append(s)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for s in socks:
            with contextlib.suppress(OSError):
                s.sendall(b" ")
        time.sleep(0.1)
    for s in socks:
        s.close()
    return 0


SCENARIOS: dict[str, Callable[[str, int], int]] = {
    "idle": lambda base, port: time.sleep(3) or 0,
    "stops-10000": lambda base, port: _post(base, {"model": NAME, "prompt": "Once upon a time", "max_tokens": 64,
                                                   "temperature": 0, "stream": True, "stop": _stops(10_000, 12)}),
    "stream": lambda base, port: _post(base, {"model": NAME, "prompt": "Once upon a time", "max_tokens": 64,
                                              "temperature": 0, "stream": True, "ignore_eos": True}),
    "stops-max": lambda base, port: _post(base, {"model": NAME, "prompt": "Once upon a time", "max_tokens": 64,
                                                 "temperature": 0, "stream": True, "ignore_eos": True,
                                                 "stop": _stops(64, 512)}),
    "prompt-1mb": lambda base, port: _post(base, {"model": NAME, "prompt": "lorem ipsum dolor sit amet " * 36_000,
                                                  "max_tokens": 1}),
    "slow-bodies": _slow_bodies,
}


# The poller runs in its own process: in this one, a tokenizer holding the GIL would stall the poller
# itself, and the latencies would measure this process rather than the server's event loop.
POLLER = """
import select, sys, time, urllib.request
while not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(sys.argv[1], timeout=60) as resp:
        resp.read()
    print((time.perf_counter() - t0) * 1e3, flush=True)
    time.sleep(0.02)
"""


def measure(base: str, port: int, scenario: Callable[[str, int], int]) -> dict[str, Any]:
    poller = subprocess.Popen([sys.executable, "-c", POLLER, base + "/health"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)  # the poller's start-up
    t0 = time.perf_counter()
    status = scenario(base, port)
    wall = time.perf_counter() - t0
    out, _ = poller.communicate("stop\n", timeout=120)
    latencies = [float(line) for line in out.split()]
    return {"health_p50_ms": round(statistics.median(latencies), 1), "health_max_ms": round(max(latencies), 1),
            "polls": len(latencies), "scenario_s": round(wall, 2), "status": status}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    llm = AsyncLLM(args.model, kv_cache_bytes=256 << 20, max_model_len=4096)
    server = uvicorn.Server(uvicorn.Config(create_app(llm, served_model_name=NAME, max_body_bytes=2 << 20),
                                           host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    _post(base, {"model": NAME, "prompt": "warm up", "max_tokens": 2})
    for name in args.scenarios:
        print(json.dumps({"scenario": name, **measure(base, port, SCENARIOS[name])}), flush=True)
    server.should_exit = True
    thread.join(timeout=30)
    llm.shutdown()


if __name__ == "__main__":
    main()
