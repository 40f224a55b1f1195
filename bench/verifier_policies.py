"""The verifier's policies against their papers' baselines, one run (``python -m bench verifier-policies``).

Every part starts real pinned fleets (the verifier on the server CPU, the rest on the edge CPU,
``bench.edge``) and serves greedy completions over the coordinator's WebSocket:

* **allocation** (GoodSpeed §IV): 3 heterogeneous drafters (draft-small, draft-large, and an
  n-gram drafter), one session each, under a global budget C, with Fixed-S (C/N each),
  Random-S and GoodSpeed. ``/status`` is polled (``bench.fairness.utility_trace``); the
  utility of the empirical average goodputs, U(x̄) = Σ log x̄, is recorded against verified
  rounds. Reported: its mean over the last half of the run, and the round after which it stays
  within ``--settle`` of that.
* **smartspec** (SmartSpec §5): target-only, fixed k for each of ``--smartspec-ks`` and
  SmartSpec at each load of ``--loads``: tokens/s and the ratio to target-only at the same load
  (SmartSpec's claim is against the best fixed k at each load, so it needs more than one).
  SmartSpec runs as ``specfleet up`` runs it, the coordinator at ``--speculation auto`` (new
  requests start target-only while SmartSpec wants no drafts, or while every drafter is busy).
* **wisp** (WISP §5): FCFS and WISP batching at each load of ``--wisp-loads``, with the fleets of
  ``bench slo`` (an n-gram drafter, so that the verifier is the bottleneck), requests spread over
  4 SLO classes (``--slo-classes``, tokens/s): the share of requests that missed their class as
  their clients saw them (the verifier's own count beside, in the JSON), and the most sessions
  served at ≤ 5 % violations.
* **trim** (AdaSpec §6): fixed k for each of ``--trim-ks``, AdaSpec's trim of the longest
  (drafters send confidences), and AdaSpec whole (its drafter controller stops early, the
  verifier trims) at each load of ``--trim-loads``, with one drafter or (``--trim-fleet mixed``)
  four whose acceptance differs.

Writes ``<out>/verifier-policies.{json,md}`` and ``<out>/goodspeed-utility.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.client import Outcome, run_load
from bench.edge import Edge, add_edge_flags, edge_from
from bench.fairness import Sample, settle_round, tracing_utility
from bench.fleets import PROMPTS, BenchFleet, Scenario, bench_fleet, bodies, given_args
from bench.load import adaspec_trims
from bench.profile import largest, smallest
from bench.run_stats import D, V, client_slo_by_class
from bench.scrape import Snapshot
from bench.slo import scenarios as slo_scenarios
from bench.slo import violations
from shared.gguf_copies import copy_path
from shared.up import resolve_models

PARTS = ("allocation", "smartspec", "wisp", "trim")
ALLOCATIONS = ("fixed", "random", "goodspeed")


# --- allocation: GoodSpeed vs Fixed-S vs Random-S ---------------------------------------------


def traced_load(bf: BenchFleet, reqs: list[dict[str, Any]], concurrency: int) -> tuple[
        list[Sample], float, list[Outcome]]:
    """Serve ``reqs`` while a thread records the utility trace from the verifier's /status."""
    with tracing_utility(bf.urls["verifier"].replace("/metrics", "/status"), 3) as trace:
        wall, outs = asyncio.run(run_load(bf.fleet.ws_url, reqs, concurrency))
    return trace, wall, outs


def allocation_part(models: Any, args: argparse.Namespace, edge: Edge, logs: Path) -> dict[str, Any]:
    """Each policy ``--allocation-repeats`` times, the policies in turn within each repeat (so that
    the machine's drift falls on all of them alike); per policy the median run by utility."""
    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in ALLOCATIONS}
    for repeat in range(args.allocation_repeats):
        for policy in ALLOCATIONS:
            runs[policy].append(allocation_run(models, args, edge, logs, policy))
            r = runs[policy][-1]
            print(f"  {policy} (run {repeat + 1}): U={r['utility']:.3f} settled at round {r['settled_round']} "
                  f"of {r['rounds']}, {r['tokens_per_s']:.1f} tokens/s", flush=True)
    out: dict[str, Any] = {}
    for policy, rs in runs.items():
        median = sorted(rs, key=lambda r: r["utility"])[len(rs) // 2]
        out[policy] = {**median, "utility_runs": [r["utility"] for r in rs],
                       "tokens_per_s_runs": [r["tokens_per_s"] for r in rs],
                       "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs)}
    return out


def allocation_run(models: Any, args: argparse.Namespace, edge: Edge, logs: Path, policy: str) -> dict[str, Any]:
    small, large = str(smallest(models.drafts)), str(largest(models.drafts))
    drafts = (small, large, small)  # the third drafts by prompt lookup (no model)
    sc = Scenario(policy, drafters=3, drafts=drafts, per_drafter_flags=((), (), ("--proposer", "ngram")),
                  draft_len=args.capacity // 3 * 2, drafter_flags=("--max-sessions", "1"),
                  verifier_flags=("--allocation", policy, "--draft-capacity", str(args.capacity),
                                  "--allocation-seed", "7"))
    started = time.perf_counter()
    with bench_fleet(models.target, sc, edge, logs) as bf:
        trace, wall, outs = traced_load(bf, bodies(args.allocation_requests, 128, models.target.name), 3)
    final, settled = settle_round([(r, avg) for r, _, avg in trace], args.settle)
    tail = trace[len(trace) // 2:]
    return {"utility": final, "settled_round": settled, "rounds": trace[-1][0] if trace else 0,
            "utility_x": sum(u for _, u, _ in tail) / len(tail) if tail else float("nan"),
            "tokens_per_s": sum(o.tokens for o in outs) / wall, "trace": trace,
            "seconds": time.perf_counter() - started}


# --- SmartSpec, WISP and the trim: tokens/s or SLO attainment by load --------------------------


def serve_loads(models: Any, scs: list[Scenario], loads: list[int], edge: Edge, logs: Path, max_tokens: int,
                repeats: int, body_extra: Callable[[int], dict[str, Any]] | None = None
                ) -> dict[str, dict[int, dict[str, Any]]]:
    """Per scenario and load: tokens/s of ``max(16, 4 x load)`` requests (the median of
    ``repeats`` runs) and the share of requests that missed their SLO class (over all runs).

    Every scenario's fleet is up at once (an idle fleet takes memory, one model copy per
    service, but next to no CPU) and each repeat runs the scenarios in turn: this machine's
    speed drifts by tens of percent from minute to minute, and scenarios measured minutes apart
    compared that drift rather than the policies. Over an emulated edge network (``--rtt-ms``
    etc.) the fleets run one at a time, as each needs the process's one edge namespace."""
    rows: dict[str, dict[int, dict[str, Any]]] = {sc.name: {} for sc in scs}
    groups = [[sc] for sc in scs] if edge.networked else [scs]  # fleets up together
    for group in groups:
        with contextlib.ExitStack() as stack:
            fleets = [(sc, stack.enter_context(bench_fleet(models.target, sc, edge, logs))) for sc in group]
            for load in loads:
                runs: dict[str, list[dict[str, float]]] = {sc.name: [] for sc in group}
                for i in range(repeats):  # each repeat starts with the next scenario: drift within one cancels too
                    for sc, bf in fleets[i % len(fleets):] + fleets[: i % len(fleets)]:
                        runs[sc.name].append(_serve_once(models, bf, load, max_tokens, body_extra))
                for name, rs in runs.items():
                    rows[name][load] = _summary(rs)
                    print(f"  {name} @{load}: {rows[name][load]}", flush=True)
    return rows


def _serve_once(models: Any, bf: BenchFleet, load: int, max_tokens: int,
                body_extra: Callable[[int], dict[str, Any]] | None) -> dict[str, float]:
    n = max(16, 4 * load)  # about 4 s of work at each load or more: shorter runs were noise
    reqs = bodies(n, max_tokens, models.target.name, prompts=PROMPTS)
    if body_extra is not None:
        reqs = [{**b, **body_extra(i)} for i, b in enumerate(reqs)]
    before = bf.scrape()
    wall, outs = asyncio.run(run_load(bf.fleet.ws_url, reqs, load))
    after = bf.scrape()
    d = after["verifier"] - before["verifier"]
    drafters = [after[name] - before[name] for name in after if name.startswith("drafter")]
    return {"tokens_per_s": sum(o.tokens for o in outs) / wall, **_slo_counts(outs, d), **_budget_counts(d),
            "drafted": sum(o.drafted for o in outs), "accepted": sum(o.accepted for o in outs), "wall_s": wall,
            "verifier_steps_s": d.value(f"{V}_step_seconds_sum", phase="total"),
            "draft_busy_s": sum(s.value(f"{D}_model_busy_seconds_total") for s in drafters),
            "trimmed": d.value(f"{V}_trimmed_tokens_total")}


def _summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    counted = sum(r["slo_counted"] for r in runs)
    missed = sum(r["violated"] * r["slo_counted"] for r in runs if r["slo_counted"])
    by_verifier = sum(r.get("verifier_counted", 0.0) for r in runs)
    at_verifier = sum(r["violated_at_verifier"] * r["verifier_counted"] for r in runs if r.get("verifier_counted"))
    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in runs)
    rounds = total("budget_rounds")  # speculating rounds the verifier handed a budget
    budgets = {"budget_zero_share": total("budget_zero") / rounds, "budget_mean": total("budget_sum") / rounds,
               "budget_changes_per_100": 100 * total("budget_changes") / rounds} if rounds else {}
    wall, drafted = total("wall_s"), total("drafted")
    busy = {"acceptance": total("accepted") / drafted if drafted else float("nan"),
            "trimmed_share": total("trimmed") / (drafted + total("trimmed")) if drafted else float("nan"),
            "verifier_busy": total("verifier_steps_s") / wall,
            "draft_busy": total("draft_busy_s") / wall} if wall else {}
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "tokens_per_s_runs": [r["tokens_per_s"] for r in runs], **busy,
            "violated": missed / counted if counted else float("nan"),
            "violated_at_verifier": at_verifier / by_verifier if by_verifier else float("nan"), "slo_counted": counted,
            **budgets}


def _budget_counts(d: Snapshot) -> dict[str, float]:
    """The draft budgets the verifier handed speculating rounds over a run (``d``: the change in
    its /metrics): how many, how many at 0, their sum, and how many changed a session's budget."""
    name = "specfleet_verifier_draft_budget"
    return {"budget_rounds": d.value(f"{name}_tokens_count"), "budget_zero": d.value(f"{name}_tokens_bucket", le="0.0"),
            "budget_sum": d.value(f"{name}_tokens_sum"), "budget_changes": d.value(f"{name}_changes_total")}


def _slo_counts(outs: list[Outcome], d: Snapshot) -> dict[str, float]:
    """The share of a run's requests with an SLO class that missed it as their clients saw them
    (``Outcome.slo_met``), how many had one, and the share the verifier counted as missed (``d``:
    the change in its /metrics; from each session's arrival there)."""
    def total(outcome: str) -> float:
        return sum(v for k, v in d.items()
                   if k[0] == "specfleet_verifier_slo_requests_total" and ("outcome", outcome) in k[1])
    attained, violated = total("attained"), total("violated")
    per_class = client_slo_by_class(outs)
    return {"violated": violations({"slo_client": per_class, "slo": {}}),
            "slo_counted": sum(c["requests"] for c in per_class.values()),
            "violated_at_verifier": violated / (attained + violated) if attained + violated else float("nan"),
            "verifier_counted": attained + violated}


def smartspec_part(models: Any, args: argparse.Namespace, edge: Edge, logs: Path) -> dict[str, Any]:
    draft = str(smallest(models.drafts))
    scs = [Scenario("target-only"), *(Scenario(f"fixed k={k}", drafters=1, draft=draft, draft_len=k)
                                      for k in args.smartspec_ks),
           Scenario("smartspec", drafters=1, draft=draft, draft_len=args.draft_len, speculation="auto",
                    verifier_flags=("--allocation", "smartspec", *_estimator_flags(args)))]
    if args.smartspec_forward_only:
        scs.append(Scenario("smartspec forward-only", drafters=1, draft=draft, draft_len=args.draft_len,
                            speculation="auto", verifier_flags=("--allocation", "smartspec", "--smartspec-overhead",
                                                                "false", *_estimator_flags(args))))
    return serve_loads(models, scs, args.loads, edge, logs, args.max_tokens, args.repeats)


def wisp_part(models: Any, args: argparse.Namespace, edge: Edge, logs: Path) -> dict[str, Any]:
    draft = str(smallest(models.drafts))
    classes = args.slo_classes

    def slo(i: int) -> dict[str, Any]:
        return {"slo_tokens_per_s": classes[i % len(classes)]}
    scs = slo_scenarios(Path(draft), args.draft_len, str(args.estimator_file or ""), "ngram", max(args.wisp_loads),
                        args.wisp_network_ms)
    return serve_loads(models, scs, args.wisp_loads, edge, logs, args.max_tokens, args.repeats, slo)


def trim_part(models: Any, args: argparse.Namespace, edge: Edge, logs: Path) -> dict[str, Any]:
    fleet = trim_fleet(models, args.trim_fleet, max(args.trim_loads))
    k = max(args.trim_ks)
    scs = [Scenario("target-only"), *(Scenario(f"fixed k={j}", draft_len=j, **fleet) for j in args.trim_ks),
           *adaspec_trims(k, _estimator_flags(args), (f"adaspec trim (k={k})", f"adaspec drafter + trim (k={k})"),
                          **fleet)]
    return serve_loads(models, scs, args.trim_loads, edge, logs, args.max_tokens, args.repeats)


def trim_fleet(models: Any, which: str, load: int) -> dict[str, Any]:
    """The trim part's drafters, as ``Scenario`` fields. ``one``: one drafter of the smallest
    draft. ``mixed``: the heterogeneous fleet of issue 62 (its acceptance differs from drafter to
    drafter, which is what a per-session trim can exploit and one fixed k cannot): the target's
    Q4_1 copy, its Q4_0 copy, the distilled ``models/draft-small``, and prompt lookup, each taking
    at most a quarter of ``load`` sessions (else the drafter that pulls first takes them all)."""
    if which == "one":
        return {"drafters": 1, "draft": str(smallest(models.drafts))}
    target = models.target
    drafts = (copy_path(target, "Q4_1"), copy_path(target, "Q4_0"), Path("models") / "draft-small")
    if missing := [str(d) for d in drafts if not d.exists()]:
        raise SystemExit(f"verifier-policies: --trim-fleet mixed needs {', '.join(missing)}; `specfleet "
                         "fetch-model` makes the GGUF copies (llama.cpp installed), the distilled drafts are committed")
    cap = ("--max-sessions", str(-(-load // 4)))
    return {"drafters": 4, "drafts": (*map(str, drafts), str(target)),
            "per_drafter_flags": (cap, cap, cap, (*cap, "--proposer", "ngram"))}


def _distinct_lengths(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """``text`` as a comma list of distinct draft lengths >= 1 (each names one scenario)."""
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag} takes a comma list of draft lengths, e.g. 2,4,6; got {text!r}")
    if not ks or min(ks) < 1 or len(set(ks)) != len(ks):
        p.error(f"{flag} takes distinct draft lengths >= 1, e.g. 2,4,6; got {text!r}")
    return ks


def _estimator_flags(args: argparse.Namespace) -> tuple[str, ...]:
    return ("--estimator-file", str(args.estimator_file)) if args.estimator_file else ()


# --- report ------------------------------------------------------------------------------------


def earlier_parts(path: Path, rerun: list[str]) -> dict[str, Any]:
    """The results file's parts that this run does not redo, so that a run of some ``--parts``
    updates them and keeps the rest, each with its own time and command in ``meta.parts``."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    kept = {p: old[p] for p in PARTS if p in old and p not in rerun}
    when = old.get("meta", {}).get("when", "")
    before = old.get("meta", {}).get("parts") or {p: {"when": when} for p in kept}
    return {"meta": {"parts": {p: m for p, m in before.items() if p in kept}}, **kept}


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# Verifier policies ({results['meta']['when']}, edge: {results['meta']['edge']})", ""]
    if "allocation" in results:
        lines += ["## Allocation: GoodSpeed vs its baselines (3 heterogeneous drafters, one session each)", "",
                  "| policy | U(x̄) = Σ log x̄ (last half; median) | runs | Σ log X (last half) | settled at round "
                  "| rounds | tokens/s (median) |", "|---|---|---|---|---|---|---|"]
        lines += [_allocation_row(p, r) for p, r in results["allocation"].items()]
        lines.append("")
    for part, title, key in (("smartspec", "SmartSpec: tokens/s by load, median of the repeats (median ratio to "
                                           "target-only in the same repeat)", "tokens_per_s"),
                             ("trim", "AdaSpec trim vs fixed k: tokens/s by load (median of the repeats)",
                              "tokens_per_s"),
                             ("wisp", "WISP vs FCFS: share of requests that missed their SLO class", "violated")):
        if part in results:
            command = results["meta"].get("parts", {}).get(part, {}).get("command")
            lines += [f"## {title}", "", *([f"`{command}`", ""] if command else []),
                      *_table(results[part], key, part in ("smartspec", "trim")), ""]
        if part == "smartspec" and part in results:
            lines += _budget_table(results[part].get("smartspec", {}))
        if part == "trim" and part in results:
            lines += _trim_readings(results[part])
    return "\n".join(lines)


def _trim_readings(part: dict[str, dict[Any, dict[str, Any]]]) -> list[str]:
    """Per speculating scenario and load, over all repeats: acceptance (of the drafts the verifier
    judged), the share of drafts the trim dropped, the verifier's forwards' share of the wall time."""
    cells = [f"{name} @{n}: acceptance {r['acceptance']:.2f}, trimmed {r['trimmed_share']:.0%}, "
             f"verifier busy {r['verifier_busy']:.2f}"
             for name, rows in part.items() if name != "target-only"
             for n, r in sorted(rows.items(), key=lambda item: int(item[0])) if "trimmed_share" in r]
    return ["Over all repeats: " + "; ".join(cells), ""] if cells else []


def _budget_table(rows: dict[Any, dict[str, Any]]) -> list[str]:
    """SmartSpec's budgets by load, over all repeats: how often it had speculation off, its mean
    length, and how often a session's length changed (each change costs the drafter its lookahead)."""
    loads = sorted((int(n), r) for n, r in rows.items() if "budget_zero_share" in r)
    if not loads:
        return []
    return ["SmartSpec's budgets, over all repeats: "
            + "; ".join(f"@{n}: {r['budget_zero_share']:.0%} of rounds at 0, mean {r['budget_mean']:.1f}, "
                        f"{r['budget_changes_per_100']:.1f} changes per 100 rounds" for n, r in loads), ""]


def _allocation_row(policy: str, r: dict[str, Any]) -> str:
    runs = ", ".join(f"{u:.2f}" for u in r.get("utility_runs", [r["utility"]]))
    ux = r.get("utility_x")
    return (f"| {policy} | {r['utility']:.3f} | {runs} | {'' if ux is None else f'{ux:.3f}'} | {r['settled_round']} "
            f"| {r['rounds']} | {r['tokens_per_s']:.1f} |")


def _table(part: dict[str, dict[Any, dict[str, Any]]], key: str, ratio: bool) -> list[str]:
    loads = sorted({int(load) for rows in part.values() for load in rows})
    base = part.get("target-only", {})
    out = ["| scenario | " + " | ".join(f"@{n}" for n in loads) + " |", "|---" * (len(loads) + 1) + "|"]
    for name, rows in part.items():
        cells = []
        for n in loads:
            row = rows.get(n) or rows.get(str(n))
            value = row[key] if row else float("nan")
            ref = base.get(n) or base.get(str(n))
            if ratio and row and ref and name != "target-only":
                cells.append(f"{value:.1f} ({_ratio(row, ref, key):.2f}x)")
            else:
                cells.append(f"{value:.3f}" if key == "violated" else f"{value:.1f}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def _ratio(row: dict[str, Any], ref: dict[str, Any], key: str) -> float:
    """The median over repeats of this scenario's rate over the reference's in the same repeat
    (the two ran back to back), or the ratio of the two values for a single run."""
    mine, theirs = row.get(f"{key}_runs", []), ref.get(f"{key}_runs", [])
    if len(mine) == len(theirs) > 1 and all(b > 0 for b in theirs):
        return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
    return float(row[key] / ref[key]) if ref[key] > 0 else float("nan")


def plot(allocation: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for policy, r in allocation.items():
        if r["trace"]:
            ax.plot([t[0] for t in r["trace"]], [t[2] for t in r["trace"]], label=policy)
    ax.set_xlabel("verified rounds (all drafters)")
    ax.set_ylabel("U(x̄) = Σ log x̄ (tokens/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench verifier-policies", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--out", default="bench/results", help="results folder")
    p.add_argument("--target", default="", help="target model directory (default SmolLM2-135M-Instruct, fetched)")
    p.add_argument("--drafts", default="", help="draft models (default: the target's GGUF copies when llama.cpp "
                   "is installed, else models/draft-*); the smallest drafts (allocation's second drafter: the largest)")
    p.add_argument("--capacity", type=int, default=12, help="allocation: GoodSpeed's C")
    p.add_argument("--allocation-requests", type=int, default=24, help="allocation: requests (128 tokens) per run")
    p.add_argument("--allocation-repeats", type=int, default=3, help="allocation: runs per policy (median reported)")
    p.add_argument("--settle", type=float, default=0.05, help="allocation: U within this of its final value")
    p.add_argument("--draft-len", type=int, default=4,
                   help="wisp: the fixed k; smartspec: SmartSpec's first length and the length of its probes")
    p.add_argument("--smartspec-ks", default="2,4,6",
                   help="smartspec: the fixed k baselines (SmartSpec chooses from 0 to the verifier's "
                        "--smartspec-max-len, 8)")
    p.add_argument("--smartspec-forward-only", action="store_true",
                   help="smartspec: also run SmartSpec with the paper's forward-only batch time "
                        "(--smartspec-overhead false), beside the default that adds the verifier's busy time")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (smartspec, wisp, trim)")
    p.add_argument("--loads", default="1,4,16,64", help="smartspec: concurrent requests")
    p.add_argument("--repeats", type=int, default=3,
                   help="smartspec, wisp, trim: runs of each scenario at each load, in turn (median reported)")
    p.add_argument("--wisp-loads", default="48,64,80,96", help="wisp: concurrent requests")
    p.add_argument("--slo-classes", default="20,30,40,60", help="wisp: SLO classes, tokens/s, spread over requests")
    p.add_argument("--wisp-network-ms", type=float, default=60.0, help="wisp: WISP's T_network (as in bench slo)")
    p.add_argument("--trim-loads", default="1,16", help="trim: concurrent requests")
    p.add_argument("--trim-ks", default="2,4,6", help="trim: the fixed k baselines (the trim drafts the longest)")
    p.add_argument("--trim-fleet", choices=("one", "mixed"), default="one",
                   help="trim: one drafter of the smallest draft, or the mixed fleet (the Q4_1 and Q4_0 copies, "
                        "the distilled draft-small, prompt lookup; one drafter each)")
    p.add_argument("--estimator-file", default="", help="step-time coefficients (make profile-verifier)")
    add_edge_flags(p)
    args = p.parse_args(argv)
    args.loads = [int(x) for x in args.loads.split(",")]
    args.wisp_loads = [int(x) for x in args.wisp_loads.split(",")]
    args.trim_loads = [int(x) for x in args.trim_loads.split(",")]
    args.trim_ks = _distinct_lengths(p, "--trim-ks", args.trim_ks)
    args.smartspec_ks = _distinct_lengths(p, "--smartspec-ks", args.smartspec_ks)
    args.slo_classes = [float(x) for x in args.slo_classes.split(",")]
    parts = [x for x in args.parts.split(",") if x]
    if unknown := set(parts) - set(PARTS):
        p.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    edge = edge_from(args)
    edge.pin_self_to_edge()
    models = resolve_models(args.target, args.drafts, Path.cwd(), Path(".specfleet"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = earlier_parts(out / "verifier-policies.json", parts)
    run = {"allocation": allocation_part, "smartspec": smartspec_part, "wisp": wisp_part, "trim": trim_part}
    command = "python -m bench verifier-policies " + " ".join(given_args(argv))
    with tempfile.TemporaryDirectory() as logs:
        for part in parts:
            print(f"{part}:", flush=True)
            results[part] = run[part](models, args, edge, Path(logs))
            results["meta"]["parts"][part] = {"when": time.strftime("%Y-%m-%d %H:%M"), "edge": edge.describe(),
                                              "command": command}
    results["meta"]["when"] = "; ".join(f"{p} {m['when']}" for p, m in results["meta"]["parts"].items())
    results["meta"]["edge"] = edge.describe()
    (out / "verifier-policies.json").write_text(json.dumps(results, indent=1))
    (out / "verifier-policies.md").write_text(markdown(results))
    if "allocation" in parts:  # a kept allocation part keeps its plot
        plot(results["allocation"], out / "goodspeed-utility.png")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
