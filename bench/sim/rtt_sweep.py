"""``python -m bench sim-rtt``: what a longer round trip changes about how to draft, simulated.

The claim (issue 10): latency changes what is optimal; a longer RTT favours longer drafts,
pipelined drafting and more sessions per drafter. The real ``rtt`` scenario measures it on this
machine, where the verifier fills while drafts travel (so the draft length matters less) and one
edge core serves every drafter. This sweeps the same three choices on the simulator, with the
real policies (Fixed-S, FCFS, the fixed controller, the drafters' lookaheads and conditional
drafts) and a verifier that does not fill, for each verifier cost model:

1. draft length: k of ``--draft-lens`` at each RTT, with and without pipelined drafting, one
   session per drafter; the best k at each RTT;
2. pipelining: the best pipelined goodput over the best without;
3. sessions per drafter: each drafter serving s of ``--sessions`` sessions at k = 4, pipelined:
   each session's rate, and the most sessions a drafter serves at ``KEEP`` (90 %) or more of its
   rate with one (StarSD's point: a draft model has time for more sessions the longer each
   waits for its verdicts).

The fleet: ``--drafters`` drafters, α ``--alpha`` (0.8, about draft-small's; κ 4), 64-token
prompts, 64 output tokens, a draft-model forward of 1 ms plus 0.2 ms per session drafted
together (about the ratio measured for draft-small, ``validate.DRAFT_FORWARD_ROWS``) and 0.5 ms
a round. Every point is the median goodput of ``--seeds`` simulations, and its speed-up is over
target-only serving of the same sessions at the same RTT (which pays the round trip once per
request, not per round).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.sim.costs import COST_MODELS, DEFAULT_PROFILE, CostSpec, load_cpu_coef, parse_cost_models
from bench.sim.engine import simulate
from bench.sim.spec import DrafterSpec, Policies, SimSpec, VerifierSpec, number_list

KEEP = 0.9  # a drafter "keeps up" with s sessions while each runs at this share of one session's rate
SESSIONS_K = 4  # the draft length of the sessions-per-drafter sweep
FORWARD_S, ROW_S, ROUND_S = 1e-3, 2e-4, 5e-4  # the draft model: per forward, per session in it, per round


@dataclass(frozen=True)
class Point:
    cost: str
    rtt_ms: float
    k: int  # draft length (Fixed-S's k)
    pipelined: bool
    sessions: int  # per drafter


def spec_of(p: Point, cost: CostSpec, drafters: int, alpha: float, rounds: int) -> SimSpec:
    """The fleet of ``p``: ``drafters`` drafters of ``p.sessions`` closed-loop sessions each, stopped after
    ``rounds`` verified rounds per session on average."""
    d = DrafterSpec("d", alpha=alpha, token_s=ROW_S, forward_s=FORWARD_S, round_s=ROUND_S, rtt_s=p.rtt_ms / 1e3,
                    pipeline_sessions=p.sessions if p.pipelined else 0, concurrency=p.sessions, prompt_len=64,
                    max_tokens=64)
    return SimSpec(tuple(replace(d, name=f"d{i}") for i in range(drafters)),
                   Policies("fixed", "fcfs", "fixed", p.k, 0, max(16, p.k)), VerifierSpec(), cost,
                   rounds=rounds * p.sessions)


def points(costs: list[str], rtts: list[float], lens: list[int], sessions: list[int]) -> list[Point]:
    """The draft-length sweep (one session per drafter, both ways) and the sessions sweep (k = 4, pipelined)."""
    out = [Point(c, r, k, piped, 1) for c in costs for r in rtts for piped in (False, True) for k in lens]
    out += [Point(c, r, SESSIONS_K, True, s) for c in costs for r in rtts for s in sessions]
    return list(dict.fromkeys(out))


def run(p: Point, cost: CostSpec, args: argparse.Namespace) -> dict[str, Any]:
    """``p`` simulated with each seed, and target-only serving of its sessions over the same time."""
    seeded = [replace(spec_of(p, cost, args.drafters, args.alpha, args.rounds), seed=seed)
              for seed in range(args.seeds)]
    sims = [simulate(spec) for spec in seeded]
    bases = [simulate(spec.target_only(r.sim_s))
             for spec, r in zip(seeded, sims, strict=True)]
    goodput = statistics.median(r.goodput_tok_s for r in sims)
    base = statistics.median(r.goodput_tok_s for r in bases)
    return {"cost": p.cost, "rtt_ms": p.rtt_ms, "k": p.k, "pipelined": p.pipelined, "sessions": p.sessions,
            "goodput_tok_s": goodput, "per_session_tok_s": goodput / (args.drafters * p.sessions),
            "target_only_tok_s": base, "speedup": goodput / base if base > 0 else float("nan"),
            "mean_accepted": statistics.median(r.mean_accepted or 0.0 for r in sims),
            "lookahead_use": sum(r.lookaheads_used for r in sims) / max(1, sum(r.drafted_rounds for r in sims))}


# --- the three readings (pure) --------------------------------------------------------------


def best_k(rows: list[dict[str, Any]], cost: str, rtt_ms: float, pipelined: bool) -> dict[str, Any] | None:
    """The draft-length sweep's fastest row at one session per drafter."""
    cands = [r for r in rows if r["cost"] == cost and r["rtt_ms"] == rtt_ms and r["pipelined"] == pipelined
             and r["sessions"] == 1]
    return max(cands, key=lambda r: r["goodput_tok_s"], default=None)


def pipelining_gain(rows: list[dict[str, Any]], cost: str, rtt_ms: float) -> float | None:
    """The best pipelined goodput over the best without, at one session per drafter."""
    on, off = best_k(rows, cost, rtt_ms, True), best_k(rows, cost, rtt_ms, False)
    return on["goodput_tok_s"] / off["goodput_tok_s"] if on and off and off["goodput_tok_s"] > 0 else None


def sessions_kept(rows: list[dict[str, Any]], cost: str, rtt_ms: float, keep: float = KEEP) -> int | None:
    """The most sessions per drafter (of the sessions sweep) at which every session still runs at
    ``keep`` of one session's rate, as do all fewer; None without a one-session row."""
    sweep = sorted((r for r in rows if r["cost"] == cost and r["rtt_ms"] == rtt_ms and r["pipelined"]
                    and r["k"] == SESSIONS_K), key=lambda r: r["sessions"])
    if not sweep or sweep[0]["sessions"] != 1:
        return None
    kept = 1
    for r in sweep:
        if r["per_session_tok_s"] < keep * sweep[0]["per_session_tok_s"]:
            break
        kept = r["sessions"]
    return kept


# --- the page ---------------------------------------------------------------------------------


def _cell(r: dict[str, Any] | None, bold: bool = False) -> str:
    if r is None:
        return ""
    return f"**{r['goodput_tok_s']:.0f}**" if bold else f"{r['goodput_tok_s']:.0f}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, str], costs: list[str], rtts: list[float]) -> str:
    """The three readings as tables."""
    lens = sorted({r["k"] for r in rows if r["sessions"] == 1})
    counts = sorted({r["sessions"] for r in rows if r["k"] == SESSIONS_K and r["pipelined"]})
    at = {(r["cost"], r["rtt_ms"], r["k"], r["pipelined"], r["sessions"]): r for r in rows}
    lines = [f"Command: `{meta['command'].strip()}` ({meta['when']}; simulated: no real services run).", "",
             "**Draft length**, one session per drafter: goodput in tokens/s by k (the best in bold), and the "
             "best's speed-up over target-only serving at the same RTT.", "",
             "| cost | RTT ms | pipelined | " + " | ".join(f"k = {k}" for k in lens) + " | best k | vs target-only |",
             "|---|---|---|" + "---|" * len(lens) + "---|---|"]
    for c in costs:
        for rtt in rtts:
            for piped in (False, True):
                best = best_k(rows, c, rtt, piped)
                cells = [_cell(at.get((c, rtt, k, piped, 1)), best is not None and best["k"] == k) for k in lens]
                tail = f"{best['k']} | {best['speedup']:.2f}x" if best else " | "
                lines.append(f"| {c} | {rtt:g} | {'yes' if piped else 'no'} | {' | '.join(cells)} | {tail} |")
    lines += ["", "**Pipelining**: the best pipelined goodput over the best without (one session per drafter).", "",
              "| cost | " + " | ".join(f"RTT {rtt:g} ms" for rtt in rtts) + " |", "|---|" + "---|" * len(rtts)]
    for c in costs:
        gains = [pipelining_gain(rows, c, rtt) for rtt in rtts]
        lines.append(f"| {c} | " + " | ".join("" if g is None else f"{g:.2f}x" for g in gains) + " |")
    lines += ["", f"**Sessions per drafter** (k = {SESSIONS_K}, pipelined): each session's tokens/s with s sessions "
              f"on every drafter, and the most sessions at which each still runs at {KEEP:.0%} of one's rate.", "",
              "| cost | RTT ms | " + " | ".join(f"s = {n}" for n in counts) + f" | kept at {KEEP:.0%} | "
              f"s = {counts[-1] if counts else ''} over s = 1 |", "|---|---|" + "---|" * len(counts) + "---|---|"]
    for c in costs:
        for rtt in rtts:
            rates = [at.get((c, rtt, SESSIONS_K, True, n)) for n in counts]
            cells = ["" if r is None else f"{r['per_session_tok_s']:.1f}" for r in rates]
            kept = sessions_kept(rows, c, rtt)
            ratio = f"{rates[-1]['per_session_tok_s'] / rates[0]['per_session_tok_s']:.2f}" \
                if rates and rates[0] is not None and rates[-1] is not None and counts[0] == 1 else ""
            lines.append(f"| {c} | {rtt:g} | {' | '.join(cells)} | {'' if kept is None else kept} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], costs: list[str], path: Path) -> None:
    """Per cost model: goodput by k at each RTT (solid: pipelined), and each session's rate by
    sessions per drafter, relative to one session's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(costs), 2, figsize=(11, 3.8 * len(costs)), squeeze=False)
    for (left, right), c in zip(axes, costs, strict=True):
        for n, rtt in enumerate(sorted({r["rtt_ms"] for r in rows})):
            color = f"C{n}"  # one colour per RTT, solid with pipelining and dashed without
            for piped, style in ((True, "-"), (False, "--")):
                rs = sorted((r for r in rows if r["cost"] == c and r["rtt_ms"] == rtt and r["pipelined"] == piped
                             and r["sessions"] == 1), key=lambda r: r["k"])
                left.plot([r["k"] for r in rs], [r["goodput_tok_s"] for r in rs], style, marker="o", color=color,
                          label=f"{rtt:g} ms{'' if piped else ', no pipelining'}")
            rs = sorted((r for r in rows if r["cost"] == c and r["rtt_ms"] == rtt and r["pipelined"]
                         and r["k"] == SESSIONS_K), key=lambda r: r["sessions"])
            if rs and rs[0]["sessions"] == 1:
                right.plot([r["sessions"] for r in rs], [r["per_session_tok_s"] / rs[0]["per_session_tok_s"]
                                                         for r in rs], marker="o", color=color, label=f"{rtt:g} ms")
        right.axhline(KEEP, color="grey", linewidth=0.8)
        left.set(xlabel="draft length k", ylabel="goodput (tokens / simulated s)", title=f"{c}: draft length")
        right.set(xscale="log", xlabel="sessions per drafter", ylabel="per-session rate / one session's",
                  title=f"{c}: sessions per drafter (k = {SESSIONS_K})")
        for ax in (left, right):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the command ----------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench sim-rtt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--cost", type=parse_cost_models, default=list(COST_MODELS), help="verifier cost models: cpu, h100 or "
                                                                        "cpu,h100")
    a("--rtt-ms", type=lambda t: number_list(t, float, 0), default=[0.0, 10.0, 40.0], help="round trips, ms")
    a("--draft-lens", type=lambda t: number_list(t, int, 1), default=[1, 2, 4, 8], help="draft lengths k")
    a("--sessions", type=lambda t: number_list(t, int, 1), default=[1, 2, 4, 8, 16], help="sessions per drafter "
                                                                                   "(the first should be 1)")
    a("--drafters", type=int, default=4, help="drafters in the fleet")
    a("--alpha", type=float, default=0.8, help="every drafter's per-token acceptance rate (draft-small's "
                                                "against the demo target: 0.78–0.81 in the validated runs)")
    a("--rounds", type=int, default=100, help="verified rounds per session on average, per simulation")
    a("--seeds", type=int, default=3, help="simulations per point (seeds 0 to this − 1); a point takes their median")
    a("--estimator-file", default=str(DEFAULT_PROFILE), help="the cpu model's profiled coefficients")
    a("--out", default="bench/results", help="directory for the results files")
    a("--stem", default="sim-rtt", help="results file names: <stem>.json, <stem>.md, <stem>.png")
    return p


def _check(args: argparse.Namespace) -> str | None:
    if min(args.drafters, args.rounds, args.seeds, *args.draft_lens, *args.sessions) < 1 or not 0 <= args.alpha <= 1:
        return "--drafters, --rounds, --seeds, --draft-lens and --sessions must be >= 1, --alpha in [0, 1]"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    problem = _check(args)
    if problem:
        print(f"python -m bench sim-rtt: {problem}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    started = time.perf_counter()
    costs: list[str] = args.cost
    coef = load_cpu_coef(args.estimator_file) if "cpu" in costs else None
    models = {c: CostSpec(c, coef) if c == "cpu" and coef is not None else CostSpec(c) for c in costs}
    todo = points(costs, args.rtt_ms, args.draft_lens, args.sessions)
    rows = [run(p, models[p.cost], args) for p in tqdm(todo, desc="sim-rtt", unit="point")]
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "command": "python -m bench sim-rtt " + " ".join(argv or [])}
    (out / f"{args.stem}.json").write_text(json.dumps({"meta": meta, "settings": settings, "rows": rows}, indent=2)
                                           + "\n")
    (out / f"{args.stem}.md").write_text(markdown(rows, meta, costs, args.rtt_ms))
    plot(rows, costs, out / f"{args.stem}.png")
    print(f"wrote {out / args.stem}.{{json,md,png}} in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
