"""One sweep for the scenario benchmarks: each scenario's real fleet at each load point, one row
of :func:`bench.run_stats.summary` metrics per (scenario, point)."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.edge import Edge
from bench.fleets import BenchFleet, Run, Scenario, bench_fleet, domain_prompts, in_turn, measure
from bench.run_stats import summary

Around = Callable[[BenchFleet], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class Point:
    """One load level: closed loop at ``concurrency``, or open loop at ``arrival_rate`` requests/s."""

    label: str
    concurrency: int
    requests: int
    arrival_rate: float = 0.0


def closed(levels: Sequence[int], per_session: int = 2, least: int = 8) -> list[Point]:
    """Closed-loop points: ``per_session`` requests per session at each concurrency (at least ``least``)."""
    return [Point(f"@{n}", n, max(least, per_session * n)) for n in levels]


def in_turn_unless_networked(edge: Edge) -> bool:
    """Whether a sweep can take turns: not over an emulated edge network (one namespace per fleet,
    named by this process: one fleet at a time then), and it says so."""
    if edge.networked:
        print("emulated edge network: the setups run one after another, not in turn", flush=True)
    return not edge.networked


def sweep(target: Path, scs: Sequence[Scenario], points: Sequence[Point], args: argparse.Namespace, edge: Edge,
          desc: str, slo_classes: Sequence[float] = (), around: Around | None = None,
          interleave: bool = False) -> list[dict[str, Any]]:
    """Every scenario at every point, in one run: scenario by scenario, one fleet each; or, with
    ``interleave``, every fleet up at once and each repeat measuring the scenarios in turn (each
    repeat starting with the next one), so that a drift of the machine's speed over minutes hits
    every scenario alike. With ``around``, each point runs inside ``around(fleet)``, and what it
    yields (a trace, say) becomes the row's ``"trace"`` (not with ``interleave``)."""
    if interleave and around is not None:
        raise ValueError("sweep: around and interleave do not combine")
    total = len(scs) * len(points) * (args.repeats if interleave else 1)
    with tqdm(total=total, desc=desc, unit="run" if interleave else "point") as bar, \
            tempfile.TemporaryDirectory() as logs:
        if interleave:
            return _interleaved(target, scs, points, args, edge, slo_classes, Path(logs), bar)
        return _sequential(target, scs, points, args, edge, slo_classes, around, Path(logs), bar)


def _sequential(target: Path, scs: Sequence[Scenario], points: Sequence[Point], args: argparse.Namespace,
                edge: Edge, slo_classes: Sequence[float], around: Around | None, logs: Path,
                bar: tqdm) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for sc in scs:
        bar.set_postfix_str(sc.name)
        with bench_fleet(target, sc, edge, logs) as bf:
            for pt in points:
                with around(bf) if around else contextlib.nullcontext(None) as extra:
                    run = _measure(bf, sc, pt, args, args.repeats, args.seed, slo_classes, target.name)
                rows.append(_row(sc, pt, run, args))
                if extra is not None:
                    rows[-1]["trace"] = list(extra)
                bar.update(1)
    return rows


def _interleaved(target: Path, scs: Sequence[Scenario], points: Sequence[Point], args: argparse.Namespace,
                 edge: Edge, slo_classes: Sequence[float], logs: Path, bar: tqdm) -> list[dict[str, Any]]:
    """Repeat i of every scenario uses the same seed (``args.seed + i``), so each repeat serves
    every scenario the same requests and arrivals (``bench.fleets.in_turn``)."""
    def one(bf: BenchFleet, sc: Scenario, pt: Point, i: int) -> Run:
        run = _measure(bf, sc, pt, args, 1, args.seed + i, slo_classes, target.name)
        bar.update(1)
        return run

    done = in_turn(target, scs, edge, logs, points, args.repeats, target.name, args.temperature, one,
                   bar.set_postfix_str)
    return [_row(sc, pt, run, args) for sc, pt, run in done]


def _measure(bf: BenchFleet, sc: Scenario, pt: Point, args: argparse.Namespace, repeats: int, seed: int,
             slo_classes: Sequence[float], model: str) -> Run:
    return measure(bf, sc, pt.concurrency, repeats, pt.requests, args.max_tokens, model, args.temperature,
                   domain_prompts(args.domains), pt.arrival_rate, seed, args.trace, slo_classes)


def _row(sc: Scenario, pt: Point, run: Run, args: argparse.Namespace) -> dict[str, Any]:
    return {"scenario": sc.name, "point": pt.label, "concurrency": pt.concurrency, "arrival_rate": pt.arrival_rate,
            "requests": pt.requests, "trace": args.trace, "seed": args.seed, "max_tokens": args.max_tokens,
            "drafters": sc.drafters, "draft_len": sc.draft_len, "network": run.network,
            "speculation": sc.speculation or ("on" if sc.drafters else "off"),
            "tokens_per_s_runs": run.rates, **summary(run)}


def cell(rows: list[dict[str, Any]], scenario: str, point: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["scenario"] == scenario and r["point"] == point), None)
