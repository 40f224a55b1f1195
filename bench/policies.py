"""Drafting policies side by side (``python -m bench policies``): waste and speed, one run.

For each policy, a real pinned fleet with 1 drafter serves the same greedy workload as
``bench.serving`` (the edge emulated by pinning), beside target-only serving:

* fixed k (the baseline), threshold (stop below a confidence), AdaSpec (stop when one more
  token would lower expected tokens per second), all on the smallest draft model;
* WISP (stop at the first token its MLP predicts rejected), with a predictor trained first:
  a collection run serves other prompts (``TRAIN_PROMPTS``) with ``--controller wisp`` before it has a predictor
  (it drafts the whole budget, as fixed k does) and records every token's features and verdict
  in ``.specfleet/bench/wisp-samples.csv``; ``specfleet wisp-train``'s code trains on them and
  reports WISP's Table 4 on a held-out fifth (``<out>/wisp-predictor.md``); the policy run then
  serves with that predictor (``<out>/wisp.json``), frozen;
* n-gram prompt lookup (no draft model at all).

Reported per policy and concurrency: tokens/s (median of the repeats) and its ratio to
target-only, acceptance, and wasted drafts per committed token ((drafted - accepted) /
generated). Writes ``<out>/policies.{json,md}`` and ``<out>/wisp-predictor.md``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.edge import Edge
from bench.fleets import (
    TRAIN_PROMPTS,
    Scenario,
    add_workload_flags,
    bench_fleet,
    drafters_of,
    measure,
    prepare,
    run_meta,
    write_results,
)
from bench.profile import smallest
from bench.serving import run_all
from bench.targets import run_row
from services.drafter.control.rejection_predictor import TrainSettings, train
from services.drafter.wisp_train import load_samples
from services.drafter.wisp_train import report as wisp_report

POLICIES = {"fixed": (), "threshold 0.4": ("--controller", "threshold"), "adaspec": ("--controller", "adaspec"),
            "wisp": ("--controller", "wisp", "--wisp-train-after", "0"), "n-gram": ("--proposer", "ngram")}

SAMPLES = Path(".specfleet") / "bench" / "wisp-samples.csv"


def scenarios(draft: Path, k: int, wisp_model: Path) -> list[Scenario]:
    flags = {**POLICIES, "wisp": (*POLICIES["wisp"], "--wisp-model", str(wisp_model))}
    return [Scenario("target-only")] + [Scenario(name, drafters=1, draft=str(draft), draft_len=k, drafter_flags=f)
                                        for name, f in flags.items()]


def train_wisp(target: Path, draft: Path, args: argparse.Namespace, edge: Edge, out: Path) -> Path:
    """Collect labelled tokens from live verdicts, train WISP's predictor, report it; its path."""
    samples = SAMPLES.resolve()  # kept for `specfleet wisp-train`, out of the repository
    samples.parent.mkdir(parents=True, exist_ok=True)
    samples.unlink(missing_ok=True)
    sc = Scenario("wisp collecting", drafters=1, draft=str(draft), draft_len=args.draft_len,
                  drafter_flags=("--controller", "wisp", "--wisp-train-after", "0", "--wisp-samples", str(samples)))
    with tempfile.TemporaryDirectory() as logs, bench_fleet(target, sc, edge, Path(logs)) as bf:
        measure(bf, sc, max(args.concurrency), 1, len(TRAIN_PROMPTS), args.max_tokens, target.name, args.temperature,
                TRAIN_PROMPTS)
    x, y = load_samples(samples)
    text, _ = wisp_report(x, y, 0.2, TrainSettings())
    model = out / "wisp.json"
    train(x, y).save(model)
    when = time.strftime("%Y-%m-%d %H:%M")
    (out / "wisp-predictor.md").write_text(f"Collected by `python -m bench policies` ({when}; {edge.describe()}) from "
                                           f"fixed-k drafts, k = {args.draft_len}, temperature {args.temperature:g}."
                                           f"\n\n{text}\n")
    print(text)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench policies", description=__doc__.splitlines()[0])
    p.add_argument("--draft-len", type=int, default=6, help="the verifier's budget k (room for policies to stop)")
    add_workload_flags(p)
    args = p.parse_args(argv)
    edge, models, out = prepare(args)
    draft = smallest(models.drafts)
    wisp_model = train_wisp(models.target, draft, args, edge, out)
    runs = run_all(models.target, scenarios(draft, args.draft_len, wisp_model), args, edge)
    rows = []
    for r in runs:
        row = run_row(r, drafters_of(r) if r.scenario != "target-only" else None)
        drafted = sum(o.drafted for o in r.outcomes)
        row["waste_per_token"] = (drafted - sum(o.accepted for o in r.outcomes)) / max(1, sum(o.tokens for o in
                                                                                               r.outcomes))
        rows.append(row)
    meta = run_meta("policies", argv, edge, draft_len=args.draft_len)
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["scenario"] == "target-only"}
    lines = [f"Command: `{meta['command'].strip()}` ({meta['when']}; {meta['edge']}; verifier budget k = "
             f"{args.draft_len}).", "", "| policy | concurrency | tokens/s (median) | vs target-only | acceptance | "
             "wasted drafts per committed token |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / base[r['concurrency']]:.2f}x | {r['acceptance']:.3f} | "
              f"{r['waste_per_token']:.3f} |" for r in rows]
    write_results(out, "policies", {"meta": meta, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
