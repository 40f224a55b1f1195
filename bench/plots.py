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
