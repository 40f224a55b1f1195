"""How the simulator starts a closed loop and hands a batch's drafts off, as the real runs do: the
client's sockets send their first requests as they connect (tens of milliseconds apart), and a
drafter's session tasks send the drafts of one batch in turn. Both keep a fleet's sessions from
moving in lockstep, which the real ones did not."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from bench.fleets import Run
from bench.run_stats import summary
from bench.scrape import Snapshot
from bench.sim import CostSpec, DrafterSpec, SimSpec, simulate
from bench.sim.engine import Simulation, _first_starts
from bench.sim.validate import Knobs, drafters_of
from bench.sim.workload import first_sends_s
from tests.unit.test_bench_scenarios import real_row


@pytest.mark.parametrize(("starts", "n", "want"), [
    ((), 3, [0.0, 0.0, 0.0]),  # not recorded: all at once
    ((0.2, 0.1), 3, [0.1, 0.2, 0.2]),  # in order; more sessions than starts: the last start
    ((0.3, 0.1, 0.2), 2, [0.1, 0.2]),  # fewer sessions: the earliest
])
def test_a_closed_loops_first_requests_start_in_order(starts: tuple[float, ...], n: int, want: list[float]) -> None:
    assert _first_starts(starts, n) == want


def test_a_negative_start_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        DrafterSpec("d", starts=(0.1, -0.01))


def closed(**drafter: Any) -> SimSpec:
    base: dict[str, Any] = {"alpha": 0.7, "token_s": 2e-4, "forward_s": 5e-4, "send_s": 1e-3, "rtt_s": 0.002,
                            "max_tokens": 16, "concurrency": 2, "requests": 2}
    d = DrafterSpec("d0", **{**base, **drafter})
    return SimSpec(drafters=(d,), cost=CostSpec("h100"), rounds=None, duration_s=600.0)


def test_a_late_first_request_counts_its_latency_from_its_start() -> None:
    at_once, late = simulate(closed()), simulate(closed(starts=(0.0, 1.0)))
    assert at_once.requests_done == late.requests_done == 2
    assert late.sim_s > 1.0 > at_once.sim_s  # the run lasts past the late start ...
    assert late.latency_s is not None and late.latency_s < 0.5  # ... but no request waited for it


@pytest.mark.parametrize(("send_rows", "want"), [
    (0.0, [1.0, 1.0, 1.0]),  # not recorded: every draft after the mean hand-off
    (3.0, [0.5, 1.0, 1.5]),  # one after another, their mean the measured one at 3 sessions
    (1.0, [1.0, 2.0, 3.0]),  # measured at single sessions: each hand-off is the whole mean
])
def test_a_batch_hands_its_drafts_off_in_turn(send_rows: float, want: list[float]) -> None:
    edge = Simulation(closed(send_s=2e-3, send_rows=send_rows)).edges[0]
    rng = random.Random(0)
    assert [edge.batch_send_after(i, rng) for i in range(3)] == pytest.approx([2e-3 * w for w in want])


def test_drafts_handed_off_in_turn_reach_an_idle_verifier_apart() -> None:
    """A verifier that is idle steps as soon as a draft arrives: drafts that leave a batch one after
    another split into smaller steps than drafts that all leave at once; every token is committed."""
    spec = closed(concurrency=8, requests=8, send_s=4e-3, max_tokens=32)
    together, in_turn = simulate(spec), simulate(replace(spec, drafters=(replace(spec.drafters[0], send_rows=8.0),)))
    assert together.committed == in_turn.committed == 8 * 32
    assert together.mean_batch is not None and in_turn.mean_batch is not None
    assert in_turn.mean_batch < 0.8 * together.mean_batch


@pytest.mark.parametrize(("runs", "repeat", "want"), [
    (None, 0, []),  # an older file
    ([[10.0, 20.0]], 0, [0.01, 0.02]),
    ([[10.0], [30.0, 40.0]], 1, [0.03, 0.04]),
    ([[10.0], [30.0]], 4, [0.03]),  # a repeat it did not record: the last one's
])
def test_the_validation_reads_when_the_first_requests_were_sent(runs: list[list[float]] | None, repeat: int,
                                                                 want: list[float]) -> None:
    row = {**real_row(), **({"first_sends_ms_runs": runs} if runs is not None else {})}
    assert first_sends_s(row, repeat) == pytest.approx(want)


def test_the_drafters_take_the_first_requests_in_turn() -> None:
    row = {**real_row(), "scenario": "specfleet", "first_sends_ms_runs": [[1.0, 2.0, 3.0, 4.0]]}
    d0, d1 = drafters_of("capacity", row, {})
    assert d0.starts == pytest.approx((0.001, 0.003)) and d1.starts == pytest.approx((0.002, 0.004))


def test_the_runs_record_when_each_repeat_sent_its_first_requests() -> None:
    run = Run("s", 2, [1.0, 1.0], [], {"verifier": Snapshot()}, walls=[1.0, 1.0],
              first_sends=[[0.01234, 0.2], [0.0, 0.05]])
    assert summary(run)["first_sends_ms_runs"] == [[12.34, 200.0], [0.0, 50.0]]


@pytest.mark.parametrize(("knobs", "want"), [(Knobs(), 6.0), (Knobs(spread=True), 0.0)])
def test_a_drafter_hands_off_in_turn_at_its_measured_batches_unless_spread(knobs: Knobs, want: float) -> None:
    """Drawn from the measured send phases (``--spread``), the hand-offs already spread as a batch's
    drafts leaving in turn did."""
    own = {"draft_ms_per_token": 1.0, "drafted_per_round": 4.0, "accepted_per_round": 2.0, "send_ms": 0.5,
           "batch_sessions": 6.0, "phase_buckets_ms": {"send": [[1.0, 3], [2.0, 1]]}}
    row = {**real_row(), "scenario": "specfleet"}
    row["costs"] = {**row["costs"], "by_drafter": {"drafter-1": own, "drafter-2": own}}
    assert [d.send_rows for d in drafters_of("capacity", row, {}, knobs=knobs)] == [want, want]
