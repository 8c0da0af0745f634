"""``/metrics`` on prometheus_client (issue 35, item 4): the engine's stats as typed families, with the
speculative-decoding acceptance and the KV store tiers' hit rates, read back by prometheus_client's own
parser (no server needed: ``ServerMetrics.render`` over a stats dict of the engine's shape)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from deepinfer.server.metrics import ServerMetrics

STATS = {
    "kv_blocks_total": 100, "kv_blocks_free": 75, "num_running": 2, "num_waiting": 1, "prefix_cache_hit_rate": 0.5,
    "steps": 10, "prompt_tokens": 40, "generated_tokens": 30, "preemptions": 0,
    "spec_decode": {"verify_steps": 4, "mean_acceptance_length": 2.5, "acceptance_per_position": [0.9, 0.6]},
    "kv_tiers": {"promoted_tokens": 48, "demoted_blocks": 7, "dropped_demotions": 0, "promoted_blocks": 3,
                 "load_failures": 0,
                 "host": {"blocks": 5, "hits": 3, "misses": 1, "saves": 7, "evictions": 0, "errors": 0},
                 "disk": {"blocks": 0, "hits": 0, "misses": 0, "saves": 0, "evictions": 0, "errors": 0}},
}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_engine_stats_spec_decode_and_kv_tiers_parse() -> None:
    text = ServerMetrics().render(STATS, inflight=3)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    got = samples(text)
    assert got[("deepinfer_kv_cache_usage_ratio", ())] == 0.25
    assert got[("deepinfer_server_inflight_requests", ())] == 3
    assert got[("deepinfer_spec_decode_mean_acceptance_length", ())] == 2.5
    assert got[("deepinfer_spec_decode_acceptance_rate", (("position", "2"),))] == 0.6
    assert families["deepinfer_kv_tier_hit_rate"].type == "gauge"
    assert got[("deepinfer_kv_tier_hit_rate", (("tier", "host"),))] == 0.75
    assert got[("deepinfer_kv_tier_hit_rate", (("tier", "disk"),))] == 0.0  # nothing looked up yet
    assert got[("deepinfer_kv_tier_hits_total", (("tier", "host"),))] == 3
    assert families["deepinfer_kv_tier_promoted_tokens"].type == "counter"
    assert got[("deepinfer_kv_tier_promoted_tokens_total", ())] == 48
    assert "process_cpu_seconds" in families


def test_without_kv_tiers_there_is_no_tier_family() -> None:
    stats = {k: v for k, v in STATS.items() if k != "kv_tiers"}
    names = {f.name for f in text_string_to_metric_families(ServerMetrics().render(stats, inflight=0))}
    assert "deepinfer_kv_tier_hit_rate" not in names and "deepinfer_engine_steps" in names
