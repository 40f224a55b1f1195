"""``python -m bench sim``: simulate fleets of N drafters with the real policies, per cost model.

    python -m bench sim --drafters 100,1000,10000 --allocation goodspeed --cost cpu,h100

For each N of ``--drafters`` and each cost model of ``--cost``, builds a :class:`SimSpec` (N
drafters with the ``--alphas``, ``--rtt-ms`` and draft costs given, each spreading its values
over the fleet when written ``spread:LO:HI``), runs it and writes ``<out>/sim.json``,
``<out>/sim.md`` and ``<out>/sim.png``. With ``--target-only`` every point is also run without
speculation over the same simulated time, for the speed-up.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.sim.costs import COST_MODELS, DEFAULT_PROFILE, CostSpec, load_cpu_coef, parse_cost_models
from bench.sim.engine import simulate
from bench.sim.report import write
from bench.sim.result import SimResult
from bench.sim.spec import DrafterSpec, Policies, SimSpec, VerifierSpec, number_list, parse_alphas, parse_values
from services.drafter.control import CONTROLLERS
from services.verifier.allocation import POLICIES as ALLOCATIONS
from services.verifier.batching import POLICIES as BATCHINGS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--drafters", type=lambda t: number_list(t, int, 1), default=[100, 1000, 10000],
      help="fleet sizes N to sweep, comma-separated")
    a("--allocation", choices=ALLOCATIONS, default="fixed", help="draft-length allocation policy (the verifier's)")
    a("--batching", choices=BATCHINGS, default="fcfs", help="batch selection policy (the verifier's)")
    a("--controller", choices=sorted(CONTROLLERS), default="fixed", help="drafting controller (the drafters')")
    a("--alphas", default="spread", help="per-drafter acceptance rate: 0.7, a list cycled (0.5,0.9), "
                                         "spread (0.3..0.9 over the fleet) or spread:LO:HI")
    a("--alpha-concentration", type=float, default=4.0, help="κ of the per-token Beta(κα, κ(1−α)) acceptance "
                                                            "probabilities: small = confidence is informative")
    a("--rtt-ms", default="20", help="drafter–verifier round trip in ms: a value, a cycled list or spread:LO:HI")
    a("--draft-ms", default="1.0", help="draft model ms per drafted token: a value, a cycled list or spread:LO:HI")
    a("--draft-round-ms", type=float, default=0.5, help="fixed draft cost per round, ms")
    a("--draft-forward-ms", type=float, default=0.0, help="fixed draft-model cost per forward of a batch, ms (the "
                                                         "sessions a drafter drafts together share it; --draft-ms "
                                                         "is then per row)")
    a("--concurrency", type=int, default=1, help="closed-loop sessions per drafter")
    a("--prompt-len", type=int, default=64, help="prompt tokens per request")
    a("--max-tokens", type=int, default=32, help="output tokens per request")
    a("--slo", type=float, default=0.0, help="SLO class of every request in tokens/s (0: best effort)")
    a("--draft-len", type=int, default=4, help="Fixed-S's k and the adaptive allocators' first length")
    a("--capacity", type=int, default=0, help="GoodSpeed's C, draft tokens over all sessions (0: draft-len each)")
    a("--max-draft-tokens", type=int, default=16, help="upper bound on any draft budget")
    a("--max-batch-sessions", type=int, default=256, help="most sessions in one verifier step")
    a("--max-batch-tokens", type=int, default=8192, help="most tokens in one verifier step")
    a("--step-overhead-ms", type=float, default=0.5, help="verifier's fixed cost per step beyond the forward, ms")
    a("--round-overhead-ms", type=float, default=0.05, help="verifier's cost per session-round in a step, ms")
    a("--rounds", type=int, default=16, help="stop after this many verified rounds per drafter on average")
    a("--duration-s", type=float, default=0.0, help="also stop at this simulated time (0: no limit)")
    a("--cost", type=parse_cost_models, default=list(COST_MODELS), help="verifier cost models: cpu, h100 or cpu,h100")
    a("--estimator-file", default=str(DEFAULT_PROFILE), help="the cpu model's profiled coefficients "
                                                             "(make profile-verifier); missing: generic ones")
    a("--target-only", action="store_true", help="also run each point without speculation")
    a("--speculation-auto", action="store_true", help="new requests get a drafter only for the share the "
                                                      "allocator asks for (the coordinator's --speculation auto: "
                                                      "SmartSpec's switch-off); the others go target-only")
    a("--seed", type=int, default=0, help="seed of the synthetic tokens and Random-S")
    a("--out", default="bench/results", help="directory for the results files")
    a("--stem", default="sim", help="results file names: <stem>.json, <stem>.md, <stem>.png")
    a("--no-progress", action="store_true", help="no progress bars")
    return p


def fleet(args: argparse.Namespace, n: int) -> tuple[DrafterSpec, ...]:
    alphas = parse_alphas(args.alphas, n)
    rtts = parse_values(args.rtt_ms, n, (10.0, 100.0))
    drafts = parse_values(args.draft_ms, n, (0.5, 5.0))
    base = DrafterSpec("d", token_s=0.0, round_s=args.draft_round_ms / 1e3, forward_s=args.draft_forward_ms / 1e3,
                       concurrency=args.concurrency,
                       prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                       slo_tokens_per_s=args.slo if args.slo > 0 else None)
    return tuple(replace(base, name=f"d{i}", alpha=alphas[i], rtt_s=rtts[i] / 1e3, token_s=drafts[i] / 1e3)
                 for i in range(n))


def build_spec(args: argparse.Namespace, n: int, cost: CostSpec, speculative: bool = True) -> SimSpec:
    policies = Policies(args.allocation, args.batching, args.controller, args.draft_len, args.capacity,
                        args.max_draft_tokens)
    verifier = VerifierSpec(args.max_batch_sessions, args.max_batch_tokens, args.step_overhead_ms / 1e3,
                            args.round_overhead_ms / 1e3)
    return SimSpec(fleet(args, n), policies, verifier, cost, speculative, args.speculation_auto, args.rounds,
                   args.duration_s if args.duration_s > 0 else None, args.alpha_concentration, args.seed)


def run_point(args: argparse.Namespace, n: int, cost: CostSpec) -> list[SimResult]:
    """One (N, cost model) point; with ``--target-only`` also its baseline over the same simulated time."""
    progress = not args.no_progress and n * args.rounds >= 10_000
    spec = build_spec(args, n, cost)
    results = [simulate(spec, progress)]
    if args.target_only:
        results.append(simulate(spec.target_only(results[0].sim_s), progress))
    return results


def sweep(args: argparse.Namespace) -> list[SimResult]:
    coef = load_cpu_coef(args.estimator_file) if "cpu" in args.cost else None
    results = []
    for cost_name in args.cost:
        cost = CostSpec(cost_name, coef) if cost_name == "cpu" and coef is not None else CostSpec(cost_name)
        for n in args.drafters:
            for r in run_point(args, n, cost):
                print(f"{r.label}: {r.goodput_tok_s:.1f} tok/s, Jain {r.jain:.3f}, "
                      f"sched {r.sched_ms_mean:.3f}/{r.sched_ms_p99:.3f} ms (mean/p99), "
                      f"{r.sim_s:.2f} s simulated in {r.wall_s:.1f} s", flush=True)
                results.append(r)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        for n in args.drafters:
            build_spec(args, n, CostSpec(args.cost[0]))  # check every value before the long runs
    except ValueError as exc:
        print(f"python -m bench sim: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    results = sweep(args)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "no_progress")}
    paths = write(results, settings, Path(args.out), args.stem)
    print(f"wrote {', '.join(str(p) for p in paths)} in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
