"""Prometheus text exposition (format 0.0.4) for ``/metrics``, written by hand (no dependency).

Request metrics are recorded by ``AsyncLLM``'s engine thread when a request finishes (aborts
included); engine gauges come from ``AsyncLLM.get_stats()`` at scrape time; HTTP responses are
counted by the app.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from typing import Any

from deepinfer.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


def _fmt(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


class ServerMetrics:
    """Counters and histograms of one server; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = defaultdict(int)  # finish_reason -> finished requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.http: dict[tuple[str, int], int] = defaultdict(int)  # (endpoint, status) -> responses

    def on_finish(self, out: RequestOutput) -> None:
        """Record one finished request (called on the engine thread)."""
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        with self._lock:
            self.requests[out.outputs[0].finish_reason or "unknown"] += 1
            self.prompt_tokens += len(out.prompt_token_ids)
            self.generation_tokens += n
            if m.first_token_time is not None:
                self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
                if m.finish_time is not None and n > 1:
                    self.tpot.observe(max(0.0, (m.finish_time - m.first_token_time) / (n - 1)))
            if m.finish_time is not None:
                self.e2e.observe(max(0.0, m.finish_time - m.arrival_time))

    def on_http(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.http[(endpoint, status)] += 1

    def render(self, stats: dict[str, Any] | None, inflight: int) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{_labels(lbl)} {_fmt(v)}" for lbl, v in samples)

        def histogram(name: str, help_text: str, h: Histogram) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} histogram")
            out.extend(f'{name}_bucket{{le="{_fmt(b)}"}} {c}' for b, c in zip(h.buckets, h.counts, strict=True))
            out.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
            out.append(f"{name}_sum {_fmt(h.sum)}")
            out.append(f"{name}_count {h.count}")

        with self._lock:
            metric("deepinfer_requests_total", "counter", "Finished requests by finish reason (abort included).",
                   [({"finish_reason": r}, v) for r, v in sorted(self.requests.items())])
            metric("deepinfer_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [({}, self.prompt_tokens)])
            metric("deepinfer_generation_tokens_total", "counter", "Generated tokens of finished requests.",
                   [({}, self.generation_tokens)])
            histogram("deepinfer_time_to_first_token_seconds", "Time from arrival to the first token.", self.ttft)
            histogram("deepinfer_time_per_output_token_seconds",
                      "Mean time between output tokens after the first, per request.", self.tpot)
            histogram("deepinfer_e2e_request_latency_seconds", "Time from arrival to finish.", self.e2e)
            metric("deepinfer_http_responses_total", "counter", "HTTP responses by endpoint and status code.",
                   [({"endpoint": e, "status": str(s)}, v) for (e, s), v in sorted(self.http.items())])
        metric("deepinfer_server_inflight_requests", "gauge", "Generation requests accepted and not yet answered.",
               [({}, inflight)])
        if stats is None:
            return "\n".join(out) + "\n"
        total, free = stats["kv_blocks_total"], stats["kv_blocks_free"]
        metric("deepinfer_num_requests_running", "gauge", "Requests in the running batch.",
               [({}, stats.get("num_running", 0))])
        metric("deepinfer_num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
               [({}, stats.get("num_waiting", 0))])
        metric("deepinfer_kv_cache_usage_ratio", "gauge", "Fraction of usable KV blocks in use.",
               [({}, (total - free) / total if total else 0.0)])
        metric("deepinfer_kv_blocks_total", "gauge", "Usable KV cache blocks.", [({}, total)])
        metric("deepinfer_kv_blocks_free", "gauge", "Free KV cache blocks.", [({}, free)])
        metric("deepinfer_prefix_cache_hit_rate", "gauge", "Hit prompt tokens / looked-up prompt tokens.",
               [({}, stats["prefix_cache_hit_rate"])])
        metric("deepinfer_engine_steps_total", "counter", "Engine steps.", [({}, stats["steps"])])
        metric("deepinfer_engine_prompt_tokens_total", "counter", "Prompt tokens added to the engine.",
               [({}, stats["prompt_tokens"])])
        metric("deepinfer_engine_generated_tokens_total", "counter", "Tokens sampled by the engine.",
               [({}, stats["generated_tokens"])])
        metric("deepinfer_preemptions_total", "counter", "Preemptions by recompute.", [({}, stats["preemptions"])])
        plugin_samples = [({"plugin": name, "stat": key}, value)
                          for name, sub in sorted(stats.items()) if isinstance(sub, dict) and name != "step_time_split"
                          for key, value in sorted(_numeric_leaves(sub).items())]
        if plugin_samples:
            metric("deepinfer_plugin_stat", "gauge", "Numeric counters reported by enabled plugins (get_stats).",
                   plugin_samples)
        return "\n".join(out) + "\n"


def _numeric_leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, float]:
    leaves: dict[str, float] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            leaves.update(_numeric_leaves(value, name + "."))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, int | float) and not isinstance(item, bool):
                    leaves[f"{name}.{i}"] = item
        elif isinstance(value, int | float):
            leaves[name] = value
    return leaves
