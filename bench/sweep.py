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
from bench.fleets import BenchFleet, Scenario, bench_fleet, domain_prompts, measure
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


def sweep(target: Path, scs: Sequence[Scenario], points: Sequence[Point], args: argparse.Namespace, edge: Edge,
          desc: str, slo_classes: Sequence[float] = (), around: Around | None = None) -> list[dict[str, Any]]:
    """Every scenario at every point, in one run; scenario by scenario, one fleet each. With
    ``around``, each point runs inside ``around(fleet)``, and what it yields (a trace, say)
    becomes the row's ``"trace"``."""
    rows: list[dict[str, Any]] = []
    with tqdm(total=len(scs) * len(points), desc=desc, unit="point") as bar, tempfile.TemporaryDirectory() as logs:
        for sc in scs:
            bar.set_postfix_str(sc.name)
            with bench_fleet(target, sc, edge, Path(logs)) as bf:
                for pt in points:
                    with around(bf) if around else contextlib.nullcontext(None) as extra:
                        run = measure(bf, sc, pt.concurrency, args.repeats, pt.requests, args.max_tokens, target.name,
                                      args.temperature, domain_prompts(args.domains), pt.arrival_rate, args.seed,
                                      args.trace, slo_classes)
                    rows.append({"scenario": sc.name, "point": pt.label, "concurrency": pt.concurrency,
                                 "arrival_rate": pt.arrival_rate, "requests": pt.requests, "trace": args.trace,
                                 "seed": args.seed, "max_tokens": args.max_tokens, "drafters": sc.drafters,
                                 "draft_len": sc.draft_len, "network": run.network,
                                 "tokens_per_s_runs": run.rates, **summary(run)})
                    if extra is not None:
                        rows[-1]["trace"] = list(extra)
                    bar.update(1)
    return rows


def cell(rows: list[dict[str, Any]], scenario: str, point: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["scenario"] == scenario and r["point"] == point), None)
