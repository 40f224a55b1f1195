"""What a row costs on each core, and the ceiling it puts on speculation: ``python -m bench row-costs``.

Times, in one run, the two forwards a speculative round is made of, each on its own core as the edge
emulation pins them:

* the target's verification on the server CPU (the verifier's batch-invariant runner, dtype auto):
  ``S`` sessions of ``--context`` cached tokens, each fed ``k + 1`` rows (its last token and ``k``
  drafts; ``k = 0`` is target-only decoding);
* the GGUF copy's draft step on the edge CPU (specfleet's 4-bit kernel, its float16 KV cache): the
  same ``S`` sessions, one row each, as a drafter batches them.

From them, for each ``S``, the **ceiling**: the best ratio to target-only that any schedule could reach
if both cores were busy all the time on nothing else, every step held all ``S`` sessions, and drafts of
``k`` tokens were accepted token by token with ``--alpha`` (a round then commits
``E(k) = (1 - α^(k+1)) / (1 - α)`` tokens):

    target-only         T_v(S, 1) / S                     seconds of verifier a token
    verifier, drafting  T_v(S, k + 1) / (S E(k))
    edge, drafting      k T_d(S) / (S E(k))               (k forwards of S rows a round)
    ceiling             max over k of  target-only / max(verifier, edge)

Nothing here is free in the real fleet (the edge core also runs the coordinator and the clients;
rounds wait on each other), so the fleet's measured ratio stays below it. Writes
``<out>/row-costs.{json,md}``.

    python -m bench row-costs [--sessions 1,4,16] [--context 200] [--max-k 8] [--alpha 0.98]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.edge import Edge, add_edge_flags, edge_from, run_pinned
from bench.fleets import run_meta, write_results
from shared.gguf_copies import copy_path
from shared.up import resolve_models
from training.evaluate_gguf import cpu_flag_summary


@dataclass(frozen=True)
class Ceiling:
    sessions: int
    k: int  # the draft length that reaches it
    ratio: float  # the ceiling: target-only's seconds a token over the busier core's
    target_only_ms: float  # verifier milliseconds a token, target-only
    verifier_ms: float  # ... a committed token, speculating at k
    edge_ms: float  # edge milliseconds a committed token at k
    verifier_alone: float  # the ratio if drafts were free (the edge never the bound), at its own best k


def tokens_per_round(alpha: float, k: int) -> float:
    """Tokens a round of ``k`` drafts commits when each is accepted with ``alpha`` until the first
    rejection, plus the verifier's own token."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def ceiling(sessions: int, verify_s: Callable[[int], float], draft_s: float, alpha: float, max_k: int) -> Ceiling:
    """The best ratio to target-only over k = 1..max_k (module docstring). ``verify_s(rows)``: one
    verification of ``sessions`` sessions fed ``rows`` rows each; ``draft_s``: one draft step of
    ``sessions`` rows."""
    alone = verify_s(1) / sessions

    def costs(k: int) -> tuple[float, float]:
        made = sessions * tokens_per_round(alpha, k)
        return verify_s(k + 1) / made, k * draft_s / made

    best = max(range(1, max_k + 1), key=lambda k: alone / max(costs(k)))
    verifier, edge = costs(best)
    free = max(alone / costs(k)[0] for k in range(1, max_k + 1))
    return Ceiling(sessions, best, alone / max(verifier, edge), alone * 1e3, verifier * 1e3, edge * 1e3, free)


def verify_grid(target: str, sessions: Sequence[int], max_rows: int, context: int, repeats: int) -> list[float]:
    """Median seconds of each (sessions, rows) verification, rows 1..max_rows, sessions in order."""
    import torch

    from services.verifier.batching.estimator import SegmentShape
    from services.verifier.profile import make_runner, time_batch
    from shared.models import load_model

    torch.set_num_threads(1)
    loaded = load_model(target)
    batches = [[SegmentShape(new=r, cached=context)] * s for s in sessions for r in range(1, max_rows + 1)]
    runner = make_runner(loaded, batches)
    for _ in range(3):
        time_batch(runner, batches[0])
    times: list[list[float]] = [[] for _ in batches]
    for _ in range(repeats):  # passes through the grid: a burst of noise spoils one pass, not one shape
        for shapes, seen in zip(batches, times, strict=True):
            seen.append(time_batch(runner, shapes))
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench row-costs", description=__doc__.splitlines()[0])
    p.add_argument("--sessions", default="1,4,16", help="sessions a step holds (comma list)")
    p.add_argument("--context", type=int, default=200, help="tokens cached per session")
    p.add_argument("--max-k", type=int, default=8, help="the longest draft considered")
    p.add_argument("--alpha", type=float, default=0.0,
                   help="per-token acceptance; 0: the copy's greedy agreement in models/gguf/MEASUREMENTS.json")
    p.add_argument("--width", default="Q4_1", help="which GGUF copy drafts (Q4_1 or Q8_0)")
    p.add_argument("--repeats", type=int, default=5, help="passes through the verifier's grid")
    p.add_argument("--steps", type=int, default=20, help="draft steps timed per session count")
    p.add_argument("--target", default="")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--verify", default="", help=argparse.SUPPRESS)  # a pinned child: "target,sessions,rows,ctx,reps"
    add_edge_flags(p)
    args = p.parse_args(argv)
    if args.verify:
        target, sessions, rows, context, repeats = args.verify.split(",")
        grid = verify_grid(target, [int(s) for s in sessions.split(":")], int(rows), int(context), int(repeats))
        print(json.dumps({"seconds": grid}))
        return 0
    edge = edge_from(args)
    sessions = [int(s) for s in args.sessions.split(",")]
    target = resolve_models(args.target, "", Path.cwd(), Path(".specfleet")).target
    alpha = args.alpha or measured_agreement(args.width)
    rows = args.max_k + 1
    spec = f"{target},{':'.join(map(str, sessions))},{rows},{args.context},{args.repeats}"
    print(f"timing the target's verifications on CPU {edge.server_cpus or 'any'} ...", flush=True)
    grid = run_pinned("bench.row_costs", edge.server_cpus, ["--verify", spec])["seconds"]
    path = str(copy_path(target, args.width))
    results: list[dict[str, Any]] = []
    for i, s in enumerate(sessions):
        one = f"{path},float16,{s},{args.context},{args.steps}"
        draft = float(run_pinned("bench.draft_steps", edge.edge_cpus, ["--one", one])["step_ms"]) / 1e3
        verify: list[float] = grid[i * rows : (i + 1) * rows]
        c = ceiling(s, partial(_nth, verify), draft, alpha, args.max_k)
        results.append({**asdict(c), "draft_step_ms": draft * 1e3, "verify_ms": [v * 1e3 for v in verify]})
        print(f"{s:2d} sessions: ceiling {c.ratio:.2f}x at k = {c.k} (verifier {c.verifier_ms:.2f}, edge "
              f"{c.edge_ms:.2f} ms a token, target-only {c.target_only_ms:.2f}); drafts free: {c.verifier_alone:.2f}x",
              flush=True)
    write(Path(args.out), args, argv, edge, alpha, results)
    return 0


def _nth(seconds: Sequence[float], rows: int) -> float:
    return seconds[rows - 1]


def measured_agreement(width: str) -> float:
    measured = json.loads((Path(__file__).resolve().parents[1] / "models/gguf/MEASUREMENTS.json").read_text())
    return float(measured["models"][width]["greedy_agreement"])


def write(out: Path, args: argparse.Namespace, argv: list[str] | None, edge: Edge, alpha: float,
          results: list[dict[str, Any]]) -> None:
    meta = run_meta("row-costs", argv, edge, cpu=cpu_flag_summary(), width=args.width, context=args.context,
                    alpha=alpha)
    ks = range(1, args.max_k + 2)
    lines = [f"Command: `{meta['command']}` ({meta['when']}; {meta['edge']}; {meta['cpu']}; the target in the "
             f"verifier's runner, dtype auto; the {args.width} copy on specfleet's 4-bit kernel, float16 KV cache; "
             f"{args.context} tokens cached per session; α = {alpha:.3f}).", "",
             "| sessions | draft step ms | ceiling | at k | verifier ms a token (target-only / drafting) | edge ms a "
             "token | drafts free |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['sessions']} | {r['draft_step_ms']:.2f} | {r['ratio']:.2f}x | {r['k']} | "
              f"{r['target_only_ms']:.2f} / {r['verifier_ms']:.2f} | {r['edge_ms']:.2f} | {r['verifier_alone']:.2f}x |"
              for r in results]
    lines += ["", "The verification, milliseconds, by rows fed each session (1: target-only):", "",
              "| sessions | " + " | ".join(str(k) for k in ks) + " |", "|---|" + "---|" * len(ks)]
    lines += [f"| {r['sessions']} | " + " | ".join(f"{v:.1f}" for v in r["verify_ms"]) + " |" for r in results]
    write_results(out, "row-costs", {"meta": meta, "results": results}, lines)


if __name__ == "__main__":
    raise SystemExit(main())
