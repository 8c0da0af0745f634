"""Benchmarking: workloads, metrics, the offline/concurrency runner, A/B statistics, plots and a
transformers baseline. Used by ``deepinfer bench`` and ``deepinfer ab`` (``docs/bench.md``)."""

BENCH_SCHEMA = "deepinfer.bench/1"
AB_SCHEMA = "deepinfer.ab/1"
