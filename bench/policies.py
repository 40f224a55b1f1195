"""Drafting policies side by side (``python -m bench policies``): waste and speed, one run.

For each policy, a real pinned fleet with 1 drafter serves the same greedy workload as
``bench.serving`` (the edge emulated by pinning), beside target-only serving:

* fixed k (the baseline), threshold (stop below a confidence), AdaSpec (stop when one more
  token would lower expected tokens per second), all on the smallest draft model;
* n-gram prompt lookup (no draft model at all).

Reported per policy and concurrency: tokens/s (median of the repeats) and its ratio to
target-only, acceptance, and wasted drafts per committed token ((drafted - accepted) /
generated). Writes ``<out>/policies.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.edge import add_edge_flags, edge_from
from bench.fleets import Scenario, drafters_of
from bench.profile import smallest
from bench.serving import run_all
from bench.targets import run_row
from shared.up import resolve_models

POLICIES = {"fixed": (), "threshold 0.4": ("--controller", "threshold"), "adaspec": ("--controller", "adaspec"),
            "n-gram": ("--proposer", "ngram")}


def scenarios(draft: Path, k: int) -> list[Scenario]:
    return [Scenario("target-only")] + [Scenario(name, drafters=1, draft=str(draft), draft_len=k, drafter_flags=flags)
                                        for name, flags in POLICIES.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench policies", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--draft-len", type=int, default=6, help="the verifier's budget k (room for policies to stop)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--target", default="")
    p.add_argument("--out", default="bench/results")
    add_edge_flags(p)
    args = p.parse_args(argv)
    edge = edge_from(args)
    edge.pin_self_to_edge()
    models = resolve_models(args.target, "", Path.cwd(), Path(".specfleet"))
    runs = run_all(models.target, scenarios(smallest(models.drafts), args.draft_len), args, edge)
    rows = []
    for r in runs:
        row = run_row(r, drafters_of(r) if r.scenario != "target-only" else None)
        drafted = sum(o.drafted for o in r.outcomes)
        row["waste_per_token"] = (drafted - sum(o.accepted for o in r.outcomes)) / max(1, sum(o.tokens for o in
                                                                                               r.outcomes))
        rows.append(row)
    meta = {"command": "python -m bench policies " + " ".join(argv or []), "when": time.strftime("%Y-%m-%d %H:%M"),
            "edge": edge.describe(), "draft_len": args.draft_len}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policies.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["scenario"] == "target-only"}
    lines = [f"Command: `{meta['command'].strip()}` ({meta['when']}; {meta['edge']}; verifier budget k = "
             f"{args.draft_len}).", "", "| policy | concurrency | tokens/s (median) | vs target-only | acceptance | "
             "wasted drafts per committed token |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / base[r['concurrency']]:.2f}x | {r['acceptance']:.3f} | "
              f"{r['waste_per_token']:.3f} |" for r in rows]
    (out / "policies.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
