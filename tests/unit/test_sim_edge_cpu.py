"""Drafters sharing CPU cores in the simulator (``bench/sim/edge_cpu.py``): processor sharing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.sim import CostSpec, DrafterSpec, SimSpec, simulate
from bench.sim.edge_cpu import SharedCores
from bench.sim.state import Events, Kind


def ends(cores: float, background: float, jobs: list[tuple[float, float]]) -> list[tuple[float, str]]:
    """When each job (start time, CPU seconds) ends, run through the event queue as the engine does."""
    events = Events()
    shared = SharedCores(cores, background, events)
    for i, (at, work) in enumerate(jobs):
        events.push(at, Kind.ARRIVE, (work, f"j{i}"))
    out = []
    while events:
        now, kind, payload = events.pop()
        if kind is Kind.ARRIVE:
            shared.start(now, payload[0], Kind.DRAFT_DONE, payload[1])
        else:
            out += [(now, name) for _, name in shared.finish(payload, now)]
    return out


@pytest.mark.parametrize(("cores", "background", "jobs", "expected"), [
    (1, 0, [(0, 1.0)], [(1.0, "j0")]),  # alone: its work in wall time
    (1, 0, [(0, 1.0), (0, 1.0)], [(2.0, "j0"), (2.0, "j1")]),  # two at once: half speed each
    # j1 joins halfway: both at half speed until j0 ends at 1.5, then j1 alone
    (1, 0, [(0, 1.0), (0.5, 1.0)], [(1.5, "j0"), (2.0, "j1")]),
    (1, 1, [(0, 1.0)], [(2.0, "j0")]),  # one always-running background job's worth
    (1, 0.5, [(0, 1.0)], [(1.5, "j0")]),
    (2, 0, [(0, 1.0), (0, 1.0)], [(1.0, "j0"), (1.0, "j1")]),  # a core each
    (2, 0, [(0, 1.0), (0, 1.0), (0, 1.0)], [(1.5, "j0"), (1.5, "j1"), (1.5, "j2")]),
    (1, 0, [(0, 0.0)], [(0.0, "j0")]),
])
def test_jobs_share_the_cores_equally(cores: float, background: float, jobs: list[tuple[float, float]],
                                      expected: list[tuple[float, str]]) -> None:
    got = ends(cores, background, jobs)
    assert [name for _, name in got] == [name for _, name in expected]
    assert [at for at, _ in got] == pytest.approx([at for at, _ in expected])


def test_shared_cores_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="cores > 0"):
        SharedCores(0, 0, Events())
    with pytest.raises(ValueError, match="edge_cores"):
        SimSpec(drafters=(DrafterSpec("d0"),), edge_cores=-1)


def fleet(edge_cores: float, background: float = 0.0) -> SimSpec:
    d = DrafterSpec("d0", alpha=0.7, token_s=2e-3, forward_s=1e-3, rtt_s=0.005, concurrency=2, max_tokens=40)
    drafters = tuple(replace(d, name=f"d{i}") for i in range(2))
    return SimSpec(drafters=drafters, cost=CostSpec("h100"), rounds=None, duration_s=600.0, edge_cores=edge_cores,
                   edge_background=background, shared_requests=24)


def test_drafters_on_one_core_wait_for_each_other() -> None:
    """Two drafters whose draft model dominates a round: on one shared core their batches run at
    half speed while they overlap, so rounds take longer and the fleet commits fewer tokens per
    second than with a device each; with a core each (2 cores, no background) it is the same as
    separate devices."""
    own, shared, two = simulate(fleet(0)), simulate(fleet(1)), simulate(fleet(2))
    assert own.committed == shared.committed == two.committed == 24 * 40
    assert shared.goodput_tok_s < own.goodput_tok_s
    assert two.goodput_tok_s == pytest.approx(own.goodput_tok_s)
    busy = simulate(fleet(1, background=1.0))
    assert busy.goodput_tok_s < shared.goodput_tok_s
