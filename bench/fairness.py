"""``python -m bench fairness``: heterogeneous drafters sharing a draft budget (GoodSpeed Fig. 4 shape).

N drafters (by default the real family: the target's Q4_1 and Q4_0 GGUF copies, the distilled
small draft and prompt lookup) differ in draft model, prompt domain mix and RTT (each reaches the verifier through
a delay proxy of its own, ``bench.netns``). They share GoodSpeed's global budget C of draft
tokens per round (``--capacity``) under Fixed-S (C/N each), Random-S and GoodSpeed's gradient
scheduling, each in one real pinned fleet over the same seeded workload. Every drafter serves
one session at a time, so a drafter is GoodSpeed's client.

While the load runs, the verifier's ``/status`` is polled for each drafter's smoothed goodput X
and the tokens committed through it so far; against verified rounds it records U(x̄), the
utility of the empirical average goodputs (the curve of GoodSpeed's Fig. 4), and Σ log X (what
the scheduler steers by). Reported per policy: U(x̄) over the last half of the run, the
convergence round (after which U(x̄)'s rolling mean stays within ``--settle`` of that value),
Σ log X over the last half, per-drafter goodput (tokens/s), Σ log x and Jain's index over them,
and every metric of ``bench.run_stats``. Writes ``<out>/fairness.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.edge import Edge
from bench.fleets import BenchFleet, Scenario, add_workload_flags, prepare, run_meta, write_results
from bench.profile import largest, smallest
from bench.sweep import Point, sweep
from shared.gguf_copies import copy_path

POLICIES = ("fixed", "random", "goodspeed")
#: drafter kinds: a distilled draft model (smallest or largest of models/), prompt lookup, or one
#: of the target's GGUF copies (llama.cpp: the shipped Q4_1, and the widths ``fetch-model`` makes)
GGUF_KINDS = {"q4_1": "Q4_1", "q8_0": "Q8_0", "q4_0": "Q4_0"}
KINDS = ("small", "large", "ngram", *GGUF_KINDS)
DISTILLED = Path("models")
#: the default: the real family, heterogeneous (the shipped 4-bit copy, a lower-width copy, a
#: distilled draft and prompt lookup), at 0, 10, 10 and 40 ms
REAL_FAMILY = "q4_1@0,q4_0@10,small@10,ngram@40"


def parse_drafters(text: str) -> list[tuple[str, float]]:
    """"small@0,large@10,ngram@40" -> [("small", 0.0), ...]: each drafter's kind and RTT (ms)."""
    out = []
    for item in filter(None, text.split(",")):
        kind, _, rtt = item.partition("@")
        if kind not in KINDS:
            raise ValueError(f"unknown drafter kind {kind!r} in {text!r}; choose from {', '.join(KINDS)}")
        out.append((kind, float(rtt or 0)))
    if len(out) < 2:
        raise ValueError("fairness needs at least 2 drafters")
    return out


#: one sample of the utility curve: (verified rounds, U of the smoothed X, U of the empirical average goodput)
Sample = tuple[int, float, float]


def utility_trace(status_url: str, stop: threading.Event, drafters: int, every_s: float = 0.25) -> list[Sample]:
    """Samples until ``stop``, once every drafter reported:

    * U_X = Σ_d log X_d, the verifier's smoothed goodputs (eq. 4, tokens per round; a drafter
      between sessions keeps its last X): what GoodSpeed's scheduler steers by;
    * U(x̄) = Σ_d log x̄_d with x̄_d the tokens committed through drafter d so far over the seconds
      since the trace began: the utility of the empirical average goodput that GoodSpeed's
      Fig. 4 plots, whose convergence the paper reports."""
    trace: list[Sample] = []
    last: dict[str, float] = {}
    start = time.monotonic()
    while not stop.wait(every_s):
        try:
            status = httpx.get(status_url, timeout=5).json()
        except (httpx.HTTPError, ValueError):
            continue
        last.update({name: d["goodput"] for name, d in status.get("drafters", {}).items()})
        committed = status.get("committed_by_drafter", {})
        if len(last) >= drafters and len(committed) >= drafters:
            elapsed = time.monotonic() - start
            trace.append((int(status["rounds"]), sum(math.log(max(x, 1e-9)) for x in last.values()),
                          sum(math.log(max(c / elapsed, 1e-9)) for c in committed.values())))
    return trace


@contextlib.contextmanager
def tracing_utility(status_url: str, drafters: int) -> Iterator[list[Sample]]:
    """A thread records the utility trace while the block runs; the list fills when it ends."""
    stop = threading.Event()
    trace: list[Sample] = []
    poller = threading.Thread(target=lambda: trace.extend(utility_trace(status_url, stop, drafters)))
    poller.start()
    try:
        yield trace
    finally:
        stop.set()
        poller.join()


def settle_round(trace: list[tuple[int, float]], tolerance: float, window: int = 8) -> tuple[float, int | None]:
    """U's mean over the last half, and the first round after which U's rolling mean (``window``
    samples) stays within ``tolerance`` of it (None: it never settles)."""
    if not trace:
        return float("nan"), None
    tail = [u for _, u in trace[len(trace) // 2 :]]
    final = sum(tail) / len(tail)
    settled = None
    for i in range(len(trace) - 1, -1, -1):
        recent = [u for _, u in trace[max(0, i - window + 1) : i + 1]]
        if abs(sum(recent) / len(recent) - final) > tolerance:
            break
        settled = trace[i][0]
    return final, settled


def scenario(policy: str, drafters: list[tuple[str, float]], drafts: list[Path], capacity: int,
             target: Path) -> Scenario:
    # prompt lookup reads the target's tokenizer; the distilled drafts are models/draft-*, the
    # drafts specfleet up defaults to being the GGUF copies
    distilled = sorted(DISTILLED.glob("draft-*")) or drafts
    models = {"small": str(smallest(distilled)), "large": str(largest(distilled)), "ngram": str(target),
              **{kind: str(copy_path(target, width)) for kind, width in GGUF_KINDS.items()}}
    return Scenario(policy, drafters=len(drafters), drafts=tuple(models[k] for k, _ in drafters),
                    per_drafter_flags=tuple(("--proposer", "ngram") if k == "ngram" else () for k, _ in drafters),
                    drafter_rtts=tuple(rtt for _, rtt in drafters), draft_len=max(1, capacity // len(drafters)),
                    drafter_flags=("--max-sessions", "1"),
                    verifier_flags=("--allocation", policy, "--draft-capacity", str(capacity),
                                    "--allocation-seed", "7"))


def run_policy(target: Path, sc: Scenario, args: argparse.Namespace, edge: Edge) -> dict[str, Any]:
    """One policy's fleet at one load point (every drafter busy): its row, utility trace and settling."""
    def traced(bf: BenchFleet) -> contextlib.AbstractContextManager[list[Sample]]:
        return tracing_utility(bf.urls["verifier"].replace("/metrics", "/status"), sc.drafters)
    row = sweep(target, [sc], [Point(f"@{sc.drafters}", sc.drafters, args.requests)], args, edge,
                f"fairness {sc.name}", around=traced)[0]
    trace = row.pop("trace", [])
    utility_x = sum(u for _, u, _ in trace[len(trace) // 2:]) / max(1, len(trace) - len(trace) // 2)
    final, settled = settle_round([(r, avg) for r, _, avg in trace], args.settle)
    return {**row, "utility_x": utility_x if trace else math.nan, "utility": final, "settled_round": settled,
            "rounds": trace[-1][0] if trace else 0, "trace": trace}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], drafters: list[tuple[str, float]]) -> list[str]:
    """The results table. Rounds count every drafter's rounds; "per drafter" divides by N, the
    unit of GoodSpeed's iterations (one round of every client)."""
    names = [f"drafter-{i + 1} ({k}, +{rtt:g} ms)" for i, (k, rtt) in enumerate(drafters)]
    lines = [f"Command: `{meta['command'].strip()}` ({meta['when']}; {meta['edge']}; {rows[0]['network']}).", "",
             "| policy | U(x̄) (last half) | converged at round (per drafter) | U = Σ log X (last half) | rounds | "
             "tokens/s | "
             + " | ".join(f"{n} tok/s" for n in names) + " | Σ log x | Jain | acceptance | passes/token |",
             "|---" * (10 + len(names)) + "|"]
    for r in rows:
        per = [r["goodput_by_drafter"].get(f"drafter-{i + 1}", 0.0) for i in range(len(names))]
        settled = r["settled_round"]
        when = "never" if settled is None else f"{settled} ({settled / len(names):.0f})"
        lines.append(f"| {r['scenario']} | {r['utility']:.3f} | {when} | {r['utility_x']:.3f} | "
                     f"{r['rounds']} | "
                     f"{r['goodput_tok_s']:.1f} | " + " | ".join(f"{x:.1f}" for x in per)
                     + f" | {r['sum_log_x']:.3f} | {r['jain']:.3f} | {r['acceptance']:.3f} | "
                     f"{r['passes_per_token']:.3f} |")
    lines += ["", "Where each policy's drafts went: each drafter's share of all drafted tokens, and its acceptance.",
              "",
              "| policy | " + " | ".join(f"{n} share / acceptance" for n in names) + " |",
              "|---" * (1 + len(names)) + "|"]
    for r in rows:
        cells = [r.get("drafts_by_drafter", {}).get(f"drafter-{i + 1}") for i in range(len(names))]
        lines.append(f"| {r['scenario']} | " + " | ".join("–" if c is None else
                                                           f"{c['draft_share']:.2f} / {c['acceptance']:.3f}"
                                                           for c in cells) + " |")
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, shares) = plt.subplots(1, 3, figsize=(16, 4))
    for r in rows:
        left.plot([t[0] for t in r["trace"]], [t[2] for t in r["trace"]], label=r["scenario"])
    left.set(xlabel="verified rounds (all drafters)", ylabel="U(x̄) = Σ log x̄ (tokens/s)",
             title="utility of the empirical average goodput")
    left.legend()
    names = sorted({d for r in rows for d in r["goodput_by_drafter"]})
    width = 0.8 / max(1, len(rows))
    for j, r in enumerate(rows):
        right.bar([i + j * width for i in range(len(names))], [r["goodput_by_drafter"].get(n, 0.0) for n in names],
                  width, label=r["scenario"])
    right.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    right.set(ylabel="committed tokens/s", title="goodput per drafter")
    right.legend()
    for j, r in enumerate(rows):  # where the budget went, each bar labelled with the drafter's acceptance
        cells = [r.get("drafts_by_drafter", {}).get(n, {"draft_share": 0.0, "acceptance": 0.0}) for n in names]
        bars = shares.bar([i + j * width for i in range(len(names))], [c["draft_share"] for c in cells], width,
                          label=r["scenario"])
        shares.bar_label(bars, [f"{c['acceptance']:.2f}" for c in cells], fontsize=6)
    shares.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    shares.set(ylabel="share of drafted tokens", title="draft share per drafter (labels: acceptance)")
    shares.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench fairness", description=__doc__.splitlines()[0])
    p.add_argument("--drafters", type=parse_drafters, default=parse_drafters(REAL_FAMILY),
                   help="comma list of KIND@RTT_MS per drafter, KIND in small, large (the distilled drafts), "
                        "ngram, q4_1, q8_0, q4_0 (the target's GGUF copies)")
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    p.add_argument("--capacity", type=int, default=12, help="GoodSpeed's C: draft tokens per round, all drafters")
    p.add_argument("--settle", type=float, default=0.1, help="convergence: U's rolling mean within this of its end")
    add_workload_flags(p, repeats=1, requests=30, max_tokens=128)
    p.set_defaults(domains=["code", "prose", "question"])
    args = p.parse_args(argv)
    edge, models, out = prepare(args)
    rows = [run_policy(models.target, scenario(pol, args.drafters, models.drafts, args.capacity, models.target), args,
                       edge) for pol in args.policies]
    meta = run_meta("fairness", argv, edge, capacity=args.capacity, drafters=args.drafters)
    plot(rows, out / "fairness.png")
    write_results(out, "fairness", {"meta": meta, "rows": rows}, markdown(meta, rows, args.drafters))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
