"""``/metrics`` on ``prometheus_client`` (the library every peer server uses), one registry per server.

Request metrics are recorded by ``AsyncLLM``'s engine thread when a request finishes (aborts
included); HTTP responses are counted by the app; engine gauges and counters come from
``AsyncLLM.get_stats()`` at scrape time (a collector over the stats handed to ``render``), with the
speculative-decoding acceptance, the KV store tiers' hit rates and traffic (when ``cache.kv_store`` is
on) and the process collector beside them. Counters carry no ``_created``
samples (as vLLM serves them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepinfer.outputs import RequestOutput

prometheus_client.disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)


class _EngineCollector(Collector):
    """The engine's gauges and counters from the stats of the scrape in progress."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] | None = None
        self.inflight = 0

    def collect(self) -> Iterator[Metric]:
        yield _gauge("deepinfer_server_inflight_requests", "Generation requests accepted and not yet answered.",
                     self.inflight)
        stats = self.stats
        if stats is None:
            return
        total, free = stats["kv_blocks_total"], stats["kv_blocks_free"]
        yield _gauge("deepinfer_num_requests_running", "Requests in the running batch.", stats.get("num_running", 0))
        yield _gauge("deepinfer_num_requests_waiting", "Requests waiting to be scheduled.",
                     stats.get("num_waiting", 0))
        yield _gauge("deepinfer_kv_cache_usage_ratio", "Fraction of usable KV blocks in use.",
                     (total - free) / total if total else 0.0)
        yield _gauge("deepinfer_kv_blocks_total", "Usable KV cache blocks.", total)
        yield _gauge("deepinfer_kv_blocks_free", "Free KV cache blocks.", free)
        yield _gauge("deepinfer_prefix_cache_hit_rate", "Hit prompt tokens / looked-up prompt tokens.",
                     stats["prefix_cache_hit_rate"])
        for name, help_text, key in (("deepinfer_engine_steps", "Engine steps.", "steps"),
                                     ("deepinfer_engine_prompt_tokens", "Prompt tokens added to the engine.",
                                      "prompt_tokens"),
                                     ("deepinfer_engine_generated_tokens", "Tokens sampled by the engine.",
                                      "generated_tokens"),
                                     ("deepinfer_preemptions", "Preemptions by recompute.", "preemptions")):
            yield CounterMetricFamily(name, help_text, value=stats[key])
        spec = stats.get("spec_decode")
        if isinstance(spec, dict) and spec.get("verify_steps"):
            yield _gauge("deepinfer_spec_decode_mean_acceptance_length",
                         "Tokens emitted per verify step (accepted drafts plus one).", spec["mean_acceptance_length"])
            per_position = GaugeMetricFamily("deepinfer_spec_decode_acceptance_rate",
                                             "Acceptance of draft position i given the drafts before it.",
                                             labels=["position"])
            for i, rate in enumerate(spec.get("acceptance_per_position", ()), 1):
                per_position.add_metric([str(i)], rate)
            yield per_position
        tiers = stats.get("kv_tiers")
        if isinstance(tiers, dict):
            yield from _tier_metrics(tiers)
        plugin = GaugeMetricFamily("deepinfer_plugin_stat", "Numeric counters reported by enabled plugins "
                                   "(get_stats).", labels=["plugin", "stat"])
        for name, sub in sorted(stats.items()):
            if isinstance(sub, dict) and name != "step_time_split":
                for key, value in sorted(_numeric_leaves(sub).items()):
                    plugin.add_metric([name, key], value)
        if plugin.samples:
            yield plugin


def _tier_metrics(tiers: dict[str, Any]) -> Iterator[Metric]:
    """The KV tiers' (``cache.kv_store``, kv/tiers.py) hit rate per store and their block traffic."""
    rate = GaugeMetricFamily("deepinfer_kv_tier_hit_rate", "Hit blocks / looked-up blocks of a KV store tier.",
                             labels=["tier"])
    hits = CounterMetricFamily("deepinfer_kv_tier_hits", "Blocks found in a KV store tier.", labels=["tier"])
    for name, store in sorted(tiers.items()):
        if isinstance(store, dict) and "hits" in store and "misses" in store:
            looked = store["hits"] + store["misses"]
            rate.add_metric([name], store["hits"] / looked if looked else 0.0)
            hits.add_metric([name], store["hits"])
    yield rate
    yield hits
    for key, help_text in (("promoted_tokens", "Prompt tokens loaded back from the KV store tiers."),
                           ("demoted_blocks", "Blocks saved to the KV store tiers on eviction."),
                           ("promoted_blocks", "Blocks loaded back from the KV store tiers.")):
        if key in tiers:
            yield CounterMetricFamily(f"deepinfer_kv_tier_{key}", help_text, value=tiers[key])


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


class ServerMetrics:
    """Counters and histograms of one server (its own registry); thread-safe."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        reg = self.registry
        self.requests = Counter("deepinfer_requests", "Finished requests by finish reason (abort included).",
                                ["finish_reason"], registry=reg)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of finished requests.", registry=reg)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "Generated tokens of finished requests.",
                                         registry=reg)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("deepinfer_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.", buckets=TPOT_BUCKETS,
                              registry=reg)
        self.e2e = Histogram("deepinfer_e2e_request_latency_seconds", "Time from arrival to finish.",
                             buckets=E2E_BUCKETS, registry=reg)
        self.http = Counter("deepinfer_http_responses", "HTTP responses by endpoint and status code.",
                            ["endpoint", "status"], registry=reg)
        self._engine = _EngineCollector()
        reg.register(self._engine)
        ProcessCollector(registry=reg)

    def on_finish(self, out: RequestOutput) -> None:
        """Record one finished request (called on the engine thread)."""
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        self.requests.labels(out.outputs[0].finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(n)
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            if m.finish_time is not None and n > 1:
                self.tpot.observe(max(0.0, (m.finish_time - m.first_token_time) / (n - 1)))
        if m.finish_time is not None:
            self.e2e.observe(max(0.0, m.finish_time - m.arrival_time))

    def on_http(self, endpoint: str, status: int) -> None:
        self.http.labels(endpoint, str(status)).inc()

    def render(self, stats: dict[str, Any] | None, inflight: int) -> str:
        """The exposition text of every metric, engine gauges from ``stats`` (None: the engine's are left out)."""
        with self._lock:  # one scrape at a time: the engine collector holds this scrape's stats
            self._engine.stats, self._engine.inflight = stats, inflight
            return generate_latest(self.registry).decode()


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
        elif isinstance(value, int | float) and not isinstance(value, bool):
            leaves[name] = value
    return leaves
