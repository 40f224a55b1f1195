"""Speculation over an emulated edge network (``python -m bench rtt``): what latency changes.

Drafters run in a network namespace of their own behind a delay proxy and a shaped veth pair
(``bench.netns``), at each RTT of ``--rtts`` (default 0, 10 and 40 ms, the standard points).
At each RTT, one real pinned fleet per drafting setup serves the same greedy workload as
``bench.serving``, beside target-only serving (which has no edge link, so no RTT): short drafts
(k = 2), long drafts (k = 6), and k = 4 with and without pipelined drafting, and without the
verifier's filling (``services/verifier/fill.py``: it decodes while drafts travel), at 1 and 4
concurrent sessions (one drafter serves them all). The claim under test: a longer RTT favours
longer drafts, pipelined drafting and more sessions per drafter. Writes ``<out>/rtt.{json,md,png}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.client import percentiles
from bench.fleets import Run, Scenario, add_workload_flags, prepare, run_meta, write_results
from bench.profile import smallest
from bench.serving import run_all

#: name -> (draft length, drafter flags, verifier flags)
SETUPS: dict[str, tuple[int, tuple[str, ...], tuple[str, ...]]] = {
    "k=2": (2, (), ()), "k=6": (6, (), ()), "k=4": (4, (), ()),
    "k=4 no pipelining": (4, ("--pipeline-sessions", "0"), ()), "k=4 no fill": (4, (), ("--fill", "false"))}


def scenarios(draft: Path, rtts: list[float]) -> list[Scenario]:
    out = [Scenario("target-only", rtt_ms=0.0)]
    for rtt in rtts:
        out += [Scenario(f"rtt {rtt:g} ms, {name}", drafters=1, draft=str(draft), draft_len=k, drafter_flags=flags,
                         verifier_flags=verifier, rtt_ms=rtt) for name, (k, flags, verifier) in SETUPS.items()]
    return out


def rows_of(runs: list[Run]) -> list[dict[str, Any]]:
    base = {r.concurrency: r.tokens_per_s for r in runs if r.scenario == "target-only"}
    return [{"scenario": r.scenario, "concurrency": r.concurrency, "tokens_per_s": r.tokens_per_s,
             "tokens_per_s_runs": r.rates, "vs_target_only": r.tokens_per_s / base[r.concurrency],
             "acceptance": r.acceptance, "network": r.network,
             "ttft_ms": percentiles([o.ttft_s * 1e3 for o in r.outcomes]),
             "tpot_ms": percentiles([o.tpot_s * 1e3 for o in r.outcomes if o.tokens > 1])} for r in runs]


def plot(rows: list[dict[str, Any]], rtts: list[float], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(5 * len(concurrencies), 4), squeeze=False)
    for ax, conc in zip(axes[0], concurrencies, strict=True):
        for name in SETUPS:
            ys = [next(r["vs_target_only"] for r in rows if r["concurrency"] == conc
                       and r["scenario"] == f"rtt {rtt:g} ms, {name}") for rtt in rtts]
            ax.plot(rtts, ys, marker="o", label=name)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set(title=f"{conc} concurrent session(s)", xlabel="added RTT (ms)", ylabel="tokens/s vs target-only")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "rtt.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench rtt", description=__doc__.splitlines()[0])
    p.add_argument("--rtts", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 10.0, 40.0])
    add_workload_flags(p, repeats=2, requests=8, max_tokens=64)
    args = p.parse_args(argv)
    edge, models, out = prepare(args)
    rows = rows_of(run_all(models.target, scenarios(smallest(models.drafts), args.rtts), args, edge))
    networks = sorted({r["network"] for r in rows if r["scenario"] != "target-only"})
    meta = run_meta("rtt", argv, edge, networks=networks)
    plot(rows, args.rtts, out)
    lines = [f"Command: `{meta['command'].strip()}` ({meta['when']}; {meta['edge']}; {'; '.join(networks)}).", "",
             "| scenario | concurrency | tokens/s (median) | runs | vs target-only | acceptance | TTFT p50 / p90 ms | "
             "TPOT p50 / p90 ms |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
              f"{', '.join(f'{x:.0f}' for x in r['tokens_per_s_runs'])} | {r['vs_target_only']:.2f}x | "
              f"{r['acceptance']:.3f} | {r['ttft_ms']['p50']:.1f} / {r['ttft_ms']['p90']:.1f} | "
              f"{r['tpot_ms']['p50']:.2f} / {r['tpot_ms']['p90']:.2f} |" for r in rows]
    write_results(out, "rtt", {"meta": meta, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
