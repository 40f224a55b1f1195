"""Interleaved repeats: single-repeat runs combine into one, ratios pair repeat by repeat, and the
sweep of ``bench load`` measures its setups in turn."""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import bench.fleets as fleets_mod
import bench.sweep as sweep_mod
from bench.fleets import Run, Scenario, combined
from bench.scrape import Snapshot
from bench.serving import paired_ratios
from bench.sweep import Point


def snap(**samples: float) -> Snapshot:
    return Snapshot({(name, ()): value for name, value in samples.items()})


def test_combined_keeps_every_repeat_and_sums_each_services_metrics() -> None:
    a = Run("s", 4, [100.0], [], {"verifier": snap(steps=10, cpu=1.0), "drafter-1": snap(rounds=3)}, walls=[2.0],
            client_cpu_s=0.25, first_sends=[[0.0, 0.1]])
    b = Run("s", 4, [300.0], [], {"verifier": snap(steps=5, cpu=0.5), "drafter-1": snap(rounds=4)}, walls=[1.0],
            client_cpu_s=0.5)
    c = Run("s", 4, [200.0], [], {"verifier": snap(steps=1), "drafter-1": snap(rounds=1)}, walls=[1.5],
            first_sends=[[0.2, 0.3]])
    run = combined([a, b, c])
    assert (run.scenario, run.concurrency, run.rates, run.walls) == ("s", 4, [100.0, 300.0, 200.0], [2.0, 1.0, 1.5])
    assert run.tokens_per_s == 200.0
    assert run.metrics["verifier"].value("steps") == 16 and run.metrics["verifier"].value("cpu") == 1.5
    assert run.metrics["drafter-1"].value("rounds") == 8
    assert run.client_cpu_s == 0.75
    assert run.first_sends == [[0.0, 0.1], [0.2, 0.3]]  # each repeat's, in order (b recorded none)


@pytest.mark.parametrize(("base", "spec", "ratios", "median"), [
    ([100.0, 200.0, 150.0], [150.0, 200.0, 300.0], [1.5, 1.0, 2.0], 1.5),
    # the machine slowed down in the second repeat: both scenarios did, and the pair keeps the ratio
    ([200.0, 100.0], [240.0, 120.0], [1.2, 1.2], 1.2),
])
def test_ratios_pair_the_repeats(base: list[float], spec: list[float], ratios: list[float], median: float) -> None:
    rows: list[dict[str, Any]] = [{"scenario": "target-only", "concurrency": 1, "tokens_per_s_runs": base},
            {"scenario": "1 drafter", "concurrency": 1, "tokens_per_s_runs": spec},
            {"scenario": "1 drafter", "concurrency": 4, "tokens_per_s_runs": spec}]  # no baseline at 4
    paired_ratios(rows)
    assert rows[0]["ratio_runs"] == [1.0] * len(base) and rows[0]["ratio"] == 1.0
    assert rows[1]["ratio_runs"] == pytest.approx(ratios) and rows[1]["ratio"] == pytest.approx(median)
    assert rows[2]["ratio_runs"] == [] and math.isnan(rows[2]["ratio"])


def test_combined_keeps_a_service_only_a_later_run_scraped() -> None:
    a = Run("s", 1, [1.0], [], {"verifier": snap(steps=1)})
    b = Run("s", 1, [2.0], [], {"verifier": snap(steps=2), "coordinator": snap(relays=5)})
    run = combined([a, b])
    assert run.metrics["verifier"].value("steps") == 3 and run.metrics["coordinator"].value("relays") == 5


def test_a_repeat_without_its_pair_is_left_out() -> None:
    rows: list[dict[str, Any]] = [
        {"scenario": "target-only", "concurrency": 1, "tokens_per_s_runs": [100.0, 0.0, 50.0]},
        {"scenario": "spec", "concurrency": 1, "tokens_per_s_runs": [150.0, 90.0]}]
    paired_ratios(rows)
    assert rows[1]["ratio_runs"] == [1.5] and rows[1]["ratio"] == 1.5  # repeat 2 has no target-only rate


def test_sweep_in_turn_runs_every_setup_in_each_repeat_with_that_repeats_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench load``'s sweep with ``interleave``: all fleets up at once, every repeat measuring
    each setup once (each repeat starting with the next setup), all with the repeat's seed, each
    fleet primed first; one row per setup and point, its rates in repeat order."""
    calls: list[tuple[str, str, int, int]] = []
    primed: list[str] = []

    @contextlib.contextmanager
    def fleet(target: Path, sc: Scenario, edge: Any, logs: Path) -> Iterator[Any]:
        yield SimpleNamespace(name=sc.name)

    def measure(bf: Any, sc: Scenario, concurrency: int, repeats: int, requests: int, max_tokens: int, model: str,
                temperature: float, prompts: list[str], arrival_rate: float, seed: int, *rest: Any) -> Run:
        calls.append((sc.name, f"{arrival_rate:g}", repeats, seed))
        return Run(sc.name, concurrency, [float(100 * seed + len(calls))], [], {"verifier": snap(steps=1)})

    monkeypatch.setattr(fleets_mod, "bench_fleet", fleet)  # the turns are bench.fleets.in_turn's
    monkeypatch.setattr(fleets_mod, "prime", lambda bf, model, temperature=0.0: primed.append(bf.name))
    monkeypatch.setattr(sweep_mod, "measure", measure)
    monkeypatch.setattr(sweep_mod, "summary", lambda run: {"tokens_per_s": run.tokens_per_s})
    scs = [Scenario("a"), Scenario("b"), Scenario("c")]
    points = [Point("2 req/s", 0, 8, 2.0), Point("6 req/s", 0, 8, 6.0)]
    args = argparse.Namespace(repeats=3, seed=10, max_tokens=16, temperature=0.0, domains=["code"], trace="poisson")
    rows = sweep_mod.sweep(Path("target"), scs, points, args, SimpleNamespace(), "test", interleave=True)
    at_2 = [c for c in calls if c[1] == "2"]
    assert [c[0] for c in at_2] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [c[3] for c in at_2] == [10, 10, 10, 11, 11, 11, 12, 12, 12] and {c[2] for c in calls} == {1}
    assert primed == [c[0] for c in calls]
    assert [(r["scenario"], r["point"]) for r in rows] == [(s, p.label) for p in points for s in "abc"]
    assert [int(x) // 100 for x in rows[0]["tokens_per_s_runs"]] == [10, 11, 12]  # repeat order kept
    with pytest.raises(ValueError, match="around and interleave"):
        sweep_mod.sweep(Path("t"), scs, points, args, SimpleNamespace(), "test",
                        around=lambda bf: contextlib.nullcontext(None), interleave=True)
