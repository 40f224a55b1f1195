"""``python -m bench load``: speculation policies as the arrival rate grows (SmartSpec Fig. 11 shape).

At each mean arrival rate of ``--rates`` (requests/s, open loop: seeded Poisson, or a bursty
pattern with ``--trace``; each repeat's arrivals spanning at least ``--seconds``, so that the
high rates reach a steady queue), one real pinned fleet per setup serves the same requests (every
fleet up at once, each repeat measuring the setups in turn; one after another over an emulated
edge network, whose namespace is the process's): no
speculation (target-only), fixed k for each k of ``--ks``, SmartSpec (the verifier picks the
length, 0 turning speculation off, from its step-time estimator; its coordinator runs
``--speculation auto``, which then opens new requests target-only) and AdaSpec (the drafter's
efficiency-based stop within a budget of the largest k; with ``--trim`` also the verifier's
trim of the largest k, alone and with that stop: AdaSpec whole). Reported: mean request latency and
the speedup over no speculation at the same rate (its mean latency over the setup's), TTFT
and TPOT percentiles, and the rest of ``bench.run_stats``. The claim under test: at high load
speculation (SmartSpec, AdaSpec) never loses to no speculation. Writes ``<out>/load.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from bench.fleets import Scenario, add_workload_flags, prepare, run_meta, write_results
from bench.profile import smallest
from bench.sim.costs import DEFAULT_PROFILE
from bench.sweep import Point, cell, in_turn_unless_networked, sweep


def scenarios(draft: Path, ks: list[int], estimator: str, trim: bool = False) -> list[Scenario]:
    """The setups; with ``trim`` also AdaSpec's verifier trim of the largest k (the drafter sends its
    confidences) and AdaSpec whole (the drafter's stop and the verifier's trim)."""
    est = ("--estimator-file", estimator) if estimator else ()
    top = max(ks)
    setups = [Scenario("no speculation"),
              *[Scenario(f"fixed k={k}", drafters=1, draft=str(draft), draft_len=k) for k in ks],
              Scenario("smartspec", drafters=1, draft=str(draft), draft_len=top, speculation="auto",
                       verifier_flags=("--allocation", "smartspec", "--smartspec-max-len", str(top), *est)),
              Scenario("adaspec", drafters=1, draft=str(draft), draft_len=top,
                       drafter_flags=("--controller", "adaspec"))]
    if trim:
        setups += adaspec_trims(top, est, ("adaspec trim", "adaspec + trim"), drafters=1, draft=str(draft))
    return setups


def adaspec_trims(k: int, est: tuple[str, ...], names: tuple[str, str], **fleet: Any) -> list[Scenario]:
    """AdaSpec's verifier trim of ``k`` drafts (the drafters send their confidences), and AdaSpec whole
    (its drafter's stop as well, §4-5.1 and §5.2-5.3), named ``names``, on the ``Scenario`` fields ``fleet``."""
    trim = ("--trim", "adaspec", *est)
    return [Scenario(names[0], draft_len=k, drafter_flags=("--send-confidence", "true"), verifier_flags=trim, **fleet),
            Scenario(names[1], draft_len=k, drafter_flags=("--controller", "adaspec"), verifier_flags=trim, **fleet)]


def speedups(rows: list[dict[str, Any]]) -> None:
    """Each row's speedup: no speculation's mean latency at its rate over its own."""
    for r in rows:
        base = cell(rows, "no speculation", r["point"])
        r["speedup"] = base["latency_s_mean"] / r["latency_s_mean"] if base and r["latency_s_mean"] else float("nan")


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], rates: list[float]) -> list[str]:
    names = list(dict.fromkeys(r["scenario"] for r in rows))
    lines = [f"Command: `{meta['command'].strip()}` ({meta['when']}; {meta['edge']}; trace: {meta['trace']}).", "",
             "Mean request latency in seconds (speedup over no speculation at the same rate):", "",
             "| setup | " + " | ".join(f"{x:g} req/s" for x in rates) + " |", "|---" * (1 + len(rates)) + "|"]
    for name in names:
        cells = []
        for x in rates:
            r = cell(rows, name, f"{x:g} req/s")
            cells.append(f"{r['latency_s_mean']:.2f} ({r['speedup']:.2f}x)" if r else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| setup | rate | tokens/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | acceptance | passes/token "
              "| drafted for |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['point']} | {r['goodput_tok_s']:.1f} | {r['ttft_ms']['p50']:.0f} / "
              f"{r['ttft_ms']['p90']:.0f} | {r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p90']:.1f} | "
              f"{r['acceptance']:.3f} | {r['passes_per_token']:.3f} | {share(r.get('drafted_share'))} |" for r in rows]
    lines += ["", "drafted for: the share of requests the coordinator queued for a drafter; SmartSpec runs it in "
              "`--speculation auto`, which opens new requests target-only while the verifier finds plain decoding "
              "the better goodput."]
    return lines


def requests_at(rate: float, least: int, seconds: float) -> int:
    """A repeat's requests at ``rate`` requests/s: ``least``, or enough for ``seconds`` of arrivals."""
    return max(least, math.ceil(rate * seconds))


def share(x: float | None) -> str:
    return "" if x is None or x != x else f"{x:.0%}"


def plot(rows: list[dict[str, Any]], rates: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["scenario"] for r in rows):
        mine = [cell(rows, name, f"{x:g} req/s") for x in rates]
        left.plot(rates, [r["latency_s_mean"] if r else None for r in mine], marker="o", label=name)
        right.plot(rates, [r["speedup"] if r else None for r in mine], marker="o", label=name)
    left.set(xlabel="arrival rate (requests/s)", ylabel="mean latency (s)")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    right.set(xlabel="arrival rate (requests/s)", ylabel="speedup over no speculation")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench load", description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[2.0, 6.0, 12.0, 24.0, 36.0],
                   help="mean arrival rates, requests/s (on this machine 24 and 36 keep the verifier's core "
                        "about 90 %% busy without speculation: the high-load end)")
    p.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 5])
    p.add_argument("--estimator-file", default=str(DEFAULT_PROFILE) if DEFAULT_PROFILE.exists() else "",
                   help=f"step-time coefficients (make profile-verifier; default {DEFAULT_PROFILE} when present)")
    p.add_argument("--seconds", type=float, default=4.0,
                   help="each repeat's arrivals span at least this long: at each rate, the larger of --requests "
                        "and rate x seconds requests (so that the high rates reach a steady queue)")
    p.add_argument("--trim", action="store_true",
                   help="also AdaSpec's verifier trim of the largest k, alone and with AdaSpec's drafter stop")
    add_workload_flags(p, repeats=3, requests=32, max_tokens=64)
    args = p.parse_args(argv)
    edge, models, out = prepare(args)
    points = [Point(f"{x:g} req/s", 0, requests_at(x, args.requests, args.seconds), x) for x in args.rates]
    rows = sweep(models.target, scenarios(smallest(models.drafts), args.ks, args.estimator_file, args.trim), points,
                 args, edge, "bench load", interleave=in_turn_unless_networked(edge))
    speedups(rows)
    meta = run_meta("load", argv, edge, trace=args.trace, rates=args.rates)
    plot(rows, args.rates, out / f"load{'' if args.trace == 'poisson' else '-' + args.trace}.png")
    stem = "load" if args.trace == "poisson" else f"load-{args.trace}"
    write_results(out, stem, {"meta": meta, "rows": rows}, markdown(meta, rows, args.rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
