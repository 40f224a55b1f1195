"""Write a sweep's results: ``sim.json`` (everything), ``sim.md`` (a table) and ``sim.png`` (two plots)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sim.result import SimResult

#: per-drafter goodputs are written to the JSON only for fleets up to this size (else a summary)
PER_DRAFTER_MAX = 1000


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def _per_drafter(r: SimResult) -> dict[str, Any]:
    values = sorted(r.per_drafter_tok_s)
    n = len(values)
    return {"min": values[0], "median": values[n // 2], "max": values[-1]} if n else {}


def result_row(r: SimResult) -> dict[str, Any]:
    """A result for the JSON: every field; per-drafter goodputs summarised for large fleets."""
    row = r.to_dict()
    if r.n_drafters > PER_DRAFTER_MAX:
        row["per_drafter_tok_s"] = _per_drafter(r)
    return row


def markdown(results: Sequence[SimResult], settings: dict[str, Any]) -> str:
    """The sweep as a Markdown table, one row per (cost model, N, mode)."""
    lines = [
        "# Simulated fleet (bench.sim)",
        "",
        "Discrete-event simulation running the real allocation, batching and drafting policies; the "
        "verifier's step time from the profiled CPU estimator (`cpu`) or an H100 roofline of "
        "Llama-3-8B (`h100`). Scheduling cost: wall-clock time on this machine inside "
        "`batcher.select` + `allocator.assign` per verifier step (admission: `allocator.initial` per request).",
        "",
        "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()),
        "",
        "| cost | N | mode | goodput tok/s | latency s | TTFT s | TPOT ms | accept | Jain | Σ log x "
        "| sched mean ms | sched p99 ms | admit mean ms | sched/step time | sim s | wall s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        mode = f"{r.allocation}/{r.batching}/{r.controller}" if r.speculative else "target-only"
        tpot = r.tpot_s * 1e3 if r.tpot_s is not None else None
        lines.append(
            f"| {r.cost} | {r.n_drafters} | {mode} | {r.goodput_tok_s:.1f} | {_fmt(r.latency_s)} | {_fmt(r.ttft_s)} "
            f"| {_fmt(tpot)} | {_fmt(r.acceptance_rate, 2)} | {r.jain:.3f} | {r.sum_log_x:.1f} "
            f"| {r.sched_ms_mean:.3f} | {r.sched_ms_p99:.3f} | {r.admit_ms_mean:.3f} | {r.sched_share:.2%} "
            f"| {r.sim_s:.2f} | {r.wall_s:.1f} |")
    slo = [r for r in results if r.slo_attainment]
    if slo:
        lines += ["", "SLO attainment (share of finished requests at or above their class's tokens/s):", ""]
        lines += [f"- {r.label}: " + ", ".join(f"{k} tok/s: {v:.1%}" for k, v in r.slo_attainment.items())
                  for r in slo]
    return "\n".join(lines) + "\n"


def plot(results: Sequence[SimResult], path: Path) -> None:
    """Goodput against N (left) and scheduling cost per step against N (right), one line per cost model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for cost in sorted({r.cost for r in results}):
        for speculative in (True, False):
            rs = sorted((r for r in results if r.cost == cost and r.speculative == speculative),
                        key=lambda r: r.n_drafters)
            if not rs:
                continue
            tag = cost if speculative else f"{cost} target-only"
            ns = [r.n_drafters for r in rs]
            left.plot(ns, [r.goodput_tok_s for r in rs], marker="o", label=tag)
            right.plot(ns, [r.sched_ms_mean for r in rs], marker="o", label=f"{tag} mean")
            right.plot(ns, [r.sched_ms_p99 for r in rs], marker="x", linestyle="--", label=f"{tag} p99")
    left.set(xscale="log", yscale="log", xlabel="drafters N", ylabel="goodput (tokens / simulated s)",
             title="Simulated goodput")
    right.set(xscale="log", yscale="log", xlabel="drafters N", ylabel="ms per verifier step (wall clock)",
              title="Scheduling cost: select + assign")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(results: Sequence[SimResult], settings: dict[str, Any], out: Path, stem: str = "sim") -> list[Path]:
    """Write <stem>.json, <stem>.md and <stem>.png under ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    doc = {"meta": {"when": time.strftime("%Y-%m-%d %H:%M"), "command": "python -m bench sim"}, "settings": settings,
           "runs": [result_row(r) for r in results]}
    paths[0].write_text(json.dumps(doc, indent=2) + "\n")
    paths[1].write_text(markdown(results, settings))
    plot(results, paths[2])
    return paths
