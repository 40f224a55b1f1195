"""Charts the serving benchmarks share."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def bars_by_concurrency(rows: list[dict[str, Any]], key: str, path: Path, ylabel: str, title: str,
                        baseline: float | None = None) -> None:
    """One group of bars per concurrency, one bar per scenario (``row[key]``), saved as a PNG;
    ``baseline`` draws a horizontal line (1.0 for ratios to target-only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    concs = sorted({r["concurrency"] for r in rows})
    names = list(dict.fromkeys(r["scenario"] for r in rows))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [next((r[key] for r in rows if r["scenario"] == name and r["concurrency"] == c), 0) for c in concs]
        ax.bar([j + i * width for j in range(len(concs))], vals, width, label=name)
    if baseline is not None:
        ax.axhline(baseline, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(concs))], [f"{c} concurrent" for c in concs])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def throughput_latency(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Tokens/s against TPOT (``row["tpot_ms"]``'s p50, filled, and p99, hollow), one line per
    serving across its concurrencies (labelled), saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name in dict.fromkeys(r["scenario"] for r in rows):
        mine = sorted((r for r in rows if r["scenario"] == name), key=lambda r: r["concurrency"])
        rates = [r["tokens_per_s"] for r in mine]
        (line,) = ax.plot([r["tpot_ms"]["p50"] for r in mine], rates, marker="o", label=name)
        ax.plot([r["tpot_ms"]["p99"] for r in mine], rates, marker="o", linestyle=":", color=line.get_color(),
                markerfacecolor="none")
        for r in mine:
            ax.annotate(str(r["concurrency"]), (r["tpot_ms"]["p50"], r["tokens_per_s"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 3))
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers on the log axes, not powers of ten
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("time per output token, ms (filled: p50; hollow, dotted: p99); labels: concurrent requests")
    ax.set_ylabel("tokens/s, all requests")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
