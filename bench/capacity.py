"""``python -m bench capacity``: system goodput at equal server cores (WISP Table 3 shape).

Three setups, each a real pinned fleet on the same server CPUs, serve the same closed-loop
load at each concurrency of ``--concurrency``, in turn (every fleet up at once; each repeat
measures them one after another), so a drift of the machine's speed hits all three alike:

* **specfleet**: drafters at the edge, GoodSpeed's allocation over the sessions;
* **centralized**: target-only serving, continuously batched (no drafters);
* **SLED-like**: drafters at the edge, FCFS, fixed k, and a verifier that recomputes each
  session's whole context every round (``--recompute-context``: no KV reuse across rounds);
* with ``--no-fill-too``, also **specfleet no fill**: specfleet with the verifier's filling off
  (``--fill false``): what filling while drafts travel buys at the run's RTT, and the fleet the
  simulator's default verifier (which does not fill) is compared with (``bench.sim.validate``).

Reported: committed tokens/s and the ratio to centralized serving, verifier passes per
committed token, and the rest of ``bench.run_stats``. Writes ``<out>/capacity.{json,md,png}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.fleets import Scenario, add_workload_flags, prepare, run_meta, write_results
from bench.profile import smallest
from bench.sweep import cell, closed, in_turn_unless_networked, sweep

NO_FILL = "specfleet no fill"


def scenarios(draft: Path, drafters: int, draft_len: int, no_fill_too: bool = False) -> list[Scenario]:
    def edge(name: str, *flags: str) -> Scenario:
        return Scenario(name, drafters=drafters, draft=str(draft), draft_len=draft_len, verifier_flags=flags)
    out = [Scenario("centralized"), edge("specfleet", "--allocation", "goodspeed"),
           edge("SLED-like", "--batching", "fcfs", "--recompute-context", "true")]
    if no_fill_too:
        out.append(edge(NO_FILL, "--allocation", "goodspeed", "--fill", "false"))
    return out


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"Command: `{meta['command'].strip()}` ({meta['when']}; {meta['edge']}).", "",
             "| setup | sessions | tokens/s | vs centralized | passes/token | acceptance | TPOT p50 / p90 ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = cell(rows, "centralized", r["point"])
        ratio = r["goodput_tok_s"] / base["goodput_tok_s"] if base else float("nan")
        lines.append(f"| {r['scenario']} | {r['concurrency']} | {r['goodput_tok_s']:.1f} | {ratio:.2f}x | "
                     f"{r['passes_per_token']:.3f} | {r['acceptance']:.3f} | {r['tpot_ms']['p50']:.1f} / "
                     f"{r['tpot_ms']['p90']:.1f} |")
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == name]
        ax.plot([r["concurrency"] for r in mine], [r["goodput_tok_s"] for r in mine], marker="o", label=name)
    ax.set(xlabel="concurrent sessions", ylabel="committed tokens/s", xscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench capacity", description=__doc__.splitlines()[0])
    p.add_argument("--drafters", type=int, default=2, help="drafters of the specfleet and SLED-like setups")
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--no-fill-too", action="store_true",
                   help=f"also run specfleet with the verifier's filling off ('{NO_FILL}')")
    add_workload_flags(p, repeats=1, max_tokens=64, concurrency=(4, 16, 64))
    args = p.parse_args(argv)
    edge, models, out = prepare(args)
    rows = sweep(models.target, scenarios(smallest(models.drafts), args.drafters, args.draft_len, args.no_fill_too),
                 closed(args.concurrency), args, edge, "bench capacity", interleave=in_turn_unless_networked(edge))
    meta = run_meta("capacity", argv, edge)
    plot(rows, out / "capacity.png")
    write_results(out, "capacity", {"meta": meta, "rows": rows}, markdown(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
