"""``python -m bench slo``: FCFS vs WISP batching as sessions grow (WISP Table 2 / Fig. 7 shape).

One real pinned fleet per batching policy serves closed-loop load at each number of concurrent
sessions of ``--sessions``, the policies in turn (both fleets up at once). Each fleet has one
drafter with a fixed k, drafting by n-gram lookup by default, so that the verifier and not the
one edge core is the bottleneck, as in the paper. Requests are spread over the SLO classes of
``--slo-classes`` (token-speed targets, tokens/s, the extension field ``slo_tokens_per_s``).
Reported per policy and load: the share of finished requests that missed their class, per class
and in all, as the clients saw them (a request's tokens over the time from sending it to its
last token; the verifier's own count, from the session's arrival there, beside), and the
capacity: the most sessions served with at most ``--max-violations`` violations. Writes
``<out>/slo.{json,md,png}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.fleets import Scenario, add_workload_flags, prepare, run_meta, write_results
from bench.profile import smallest
from bench.sim.costs import DEFAULT_PROFILE
from bench.sweep import closed, in_turn_unless_networked, sweep

POLICIES = ("fcfs", "wisp")


def violations(row: dict[str, Any], view: str = "slo_client") -> float:
    """Share of the row's finished requests that missed their SLO class (nan for none), as the
    clients saw them (``slo_client``, the default: from sending a request to its last token) or
    as the verifier counted them (``slo``: from the session's arrival there; rows recorded before
    the client's count existed fall back to it)."""
    per = row.get(view) or row["slo"]
    counted = sum(c["requests"] for c in per.values())
    met = sum(c["requests"] * c["attainment"] for c in per.values() if c["requests"])
    return (counted - met) / counted if counted else float("nan")


def capacity(rows: list[dict[str, Any]], policy: str, limit: float) -> int:
    """The most concurrent sessions at which ``policy`` kept violations <= ``limit`` (0: none)."""
    ok = [r["concurrency"] for r in rows if r["scenario"] == policy and violations(r) <= limit]
    return max(ok, default=0)


def scenarios(draft: Path, draft_len: int, estimator: str, proposer: str = "ngram",
              sessions: int = 64, network_ms: float = 0.0) -> list[Scenario]:
    """One fleet per policy; its drafter takes up to ``sessions`` at once, so no request waits at
    the edge and the verifier's batching decides every session's speed. WISP gets
    ``network_ms`` as its T_network (``--wisp-network-ms``)."""
    est = ("--estimator-file", estimator) if estimator else ()
    wisp = ("--wisp-network-ms", f"{network_ms:g}")
    return [Scenario(policy, drafters=1, draft=str(draft), draft_len=draft_len,
                     verifier_flags=("--batching", policy, *est, *(wisp if policy == "wisp" else ())),
                     drafter_flags=("--proposer", proposer, "--max-sessions", str(sessions)))
            for policy in POLICIES]


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], classes: list[float], limit: float) -> list[str]:
    lines = [f"Command: `{meta['command'].strip()}` ({meta['when']}; {meta['edge']}).", "",
             "| policy | sessions | violations (all) | at the verifier | "
             + " | ".join(f"missed @{c:g} tok/s" for c in classes)
             + " | tokens/s | TPOT p50 / p90 ms | batch decision ms |", "|---" * (7 + len(classes)) + "|"]
    for r in rows:
        view = r.get("slo_client") or r["slo"]
        per = [1 - view.get(f"{c:g}", {}).get("attainment", float("nan")) for c in classes]
        lines.append(f"| {r['scenario']} | {r['concurrency']} | {violations(r):.3f} | {violations(r, 'slo'):.3f} | "
                     + " | ".join(f"{x:.3f}" for x in per)
                     + f" | {r['goodput_tok_s']:.1f} | {r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p90']:.1f} | "
                     f"{r['decision_ms']['batch']:.3f} |")
    lines += ["", f"Capacity (most sessions with at most {limit:.0%} violations): "
              + ", ".join(f"{p} {capacity(rows, p, limit)}" for p in POLICIES) + "."]
    return lines


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in POLICIES:
        mine = [r for r in rows if r["scenario"] == policy]
        ax.plot([r["concurrency"] for r in mine], [violations(r) for r in mine], marker="o", label=policy)
    ax.set(xlabel="concurrent sessions", ylabel="share of requests missing their SLO class")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench slo", description=__doc__.splitlines()[0])
    # the defaults suit the default target, SmolLM2-135M-Instruct on one core (about a tenth of the
    # demo family's speed, whose run of 2026-11-27 took --sessions 16,32,...,128 --slo-classes 20,30,40,60)
    p.add_argument("--sessions", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 24, 32, 48, 64])
    p.add_argument("--slo-classes", type=lambda s: [float(x) for x in s.split(",")], default=[2.0, 3.0, 4.0, 6.0],
                   help="SLO classes (tokens/s), spread over the requests in turn")
    p.add_argument("--max-violations", type=float, default=0.05, help="capacity: the violation share allowed")
    p.add_argument("--requests-per-session", type=int, default=4,
                   help="closed loop: each session's requests in turn at each load (more: less noise, longer run)")
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--proposer", choices=("draft-model", "ngram"), default="ngram",
                   help="the drafter's proposer: n-gram lookup (next to free at the edge, which leaves the verifier "
                        "the scarce resource, as WISP assumes), or its draft model (the one edge core then paces "
                        "every session, whatever the verifier's order)")
    p.add_argument("--wisp-network-ms", type=float, default=60.0,
                   help="WISP's T_network (the verifier's --wisp-network-ms): the clients' hop and each token's "
                        "delivery, which the verifier cannot see, plus a margin (0: WISP schedules just in time for "
                        "the verifier and late for the clients)")
    p.add_argument("--estimator-file", default=str(DEFAULT_PROFILE) if DEFAULT_PROFILE.exists() else "",
                   help=f"step-time coefficients (make profile-verifier; default {DEFAULT_PROFILE} when present)")
    add_workload_flags(p, repeats=1, max_tokens=64)
    args = p.parse_args(argv)
    edge, models, out = prepare(args)
    fleets = scenarios(smallest(models.drafts), args.draft_len, args.estimator_file, args.proposer,
                       max(args.sessions), args.wisp_network_ms)
    rows = sweep(models.target, fleets, closed(args.sessions, args.requests_per_session), args, edge, "bench slo",
                 slo_classes=args.slo_classes, interleave=in_turn_unless_networked(edge))
    meta = run_meta("slo", argv, edge, slo_classes=args.slo_classes)
    meta["capacity"] = {p: capacity(rows, p, args.max_violations) for p in POLICIES}
    plot(rows, out / "slo.png")
    write_results(out, "slo", {"meta": meta, "rows": rows},
                  markdown(meta, rows, args.slo_classes, args.max_violations))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
