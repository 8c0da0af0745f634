"""PNG plots of a bench run (matplotlib, Agg backend; ``pip install deepinfer[bench]``).

- ``pareto.png``: output tok/s (all requests) against per-user tok/s over the concurrency sweep, one
  series per engine, each point labelled with its concurrency;
- ``latency_cdf.png``: empirical CDFs of TTFT, TPOT, ITL and E2EL for every run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer.bench.metrics import latency_samples


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'deepinfer[bench]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _label(run: dict[str, Any]) -> str:
    c = run.get("concurrency")
    return f"{run['engine']} " + ("offline" if c is None else f"C={c}")


def plot_pareto(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for engine in dict.fromkeys(r["engine"] for r in runs):
        pts = sorted(((r["per_user_output_throughput"], r["output_throughput"], r.get("concurrency"))
                      for r in runs if r["engine"] == engine and r["per_user_output_throughput"] is not None),
                     key=lambda p: p[0])
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=engine)
        for x, y, c in pts:
            ax.annotate("offline" if c is None else f"C={c}", (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    ax.set_xlabel("per-user output tok/s (median over requests)")
    ax.set_ylabel("output tok/s (all requests)")
    ax.set_title("throughput vs per-user speed")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_latency_cdfs(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    names = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency"))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for run in runs:
        records = run.get("_records")
        samples = latency_samples(records) if records is not None else run.get("samples", {})
        for ax, (key, _) in zip(axes.flat, names, strict=True):
            values = sorted(samples.get(key) or [])
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=_label(run))
    for ax, (_, title) in zip(axes.flat, names, strict=True):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if title != "ITL" else "fraction of gaps")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(runs: Sequence[dict[str, Any]], folder: str | Path) -> list[str]:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    return [str(plot_pareto(runs, out / "pareto.png")), str(plot_latency_cdfs(runs, out / "latency_cdf.png"))]
