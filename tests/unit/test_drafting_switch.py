"""Whether new requests get a drafter: SmartSpec's answer for a request arriving now, the answer
of the policies that never switch speculation off, and the verifier's FleetStatus that carries
it to the coordinators as soon as it flips."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from services.coordinator.share import EvenShare
from services.coordinator.verifier_pool import VerifierPool
from services.verifier import server
from services.verifier.allocation import (
    AllocationSettings,
    GoodputTracker,
    RoundStats,
    SmartSpecAllocator,
    draft_share,
    make_allocator,
)
from services.verifier.allocation.draft_wait import WAIT_HORIZON_S, DraftWaitModel
from services.verifier.metrics import VerifierMetrics
from services.verifier.server import Hub, Peer, fleet_status_loop, make_welcome
from services.verifier.sessions import Routes
from shared.protocol import FleetStatus, decode
from tests.unit.test_allocation import Linear, rs

#: saturated: at 64 live sessions every fed token costs, and plain decoding is the better goodput;
#: at 1 the step's fixed cost dominates and drafts pay (α = 2/3 from drafting 4, accepting 2)
SATURATED = Linear(1e-3, 0.5e-3)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tracker_with(sessions: int) -> GoodputTracker:
    t = GoodputTracker()
    t.open("spec", "d")
    for i in range(sessions - 1):
        t.open(f"plain{i}", None)  # target-only sessions share the verifier's steps too
    return t


def warmed(sessions: int, clock: Clock | None = None) -> tuple[Any, GoodputTracker, list[int]]:
    alloc = make_allocator("smartspec", AllocationSettings(draft_len=4, max_len=8), SATURATED)
    if clock is not None:
        alloc.wait = DraftWaitModel(clock=clock)  # type: ignore[attr-defined]
    t = tracker_with(sessions)
    ks = [alloc.assign([rs("spec", 4, 2, context=200)], t)["spec"] for _ in range(16)]
    return alloc, t, ks


@pytest.mark.parametrize(("sessions", "want"), [(1, 1.0), (2, 1.0), (64, 0.0)])
def test_smartspec_drafts_for_new_requests_only_where_it_pays(sessions: int, want: float) -> None:
    alloc, t, ks = warmed(sessions)
    assert alloc.draft_share(t) == want
    assert (ks[-1] > 0) is (want == 1.0)  # the sessions verified now get the same verdict, target-only ones counted


def test_smartspec_turns_drafting_back_on_once_the_load_has_fallen_without_any_round() -> None:
    """A new request lives through the load of the recent past: drafting for it comes back once
    the peak of live sessions is older than the horizon, with no round since to say so."""
    clock = Clock()
    alloc, t, _ = warmed(64, clock)
    for i in range(63):
        t.forget(f"plain{i}")
    t.forget("spec")
    assert alloc.peak() == 64 and alloc.draft_share(t) == 0.0  # the burst just ended
    clock.now = WAIT_HORIZON_S + 0.1
    assert alloc.peak() == 0 and alloc.draft_share(t) == 1.0  # nothing speculates, and it sees the verifier idle


@pytest.mark.parametrize(("steps", "want"), [
    ([(0.0, 5)], 5),
    ([(0.0, 5), (0.5, 9), (1.0, 3)], 9),  # the most of any step in the horizon
    ([(0.0, 40), (1.0, 3), (2.5, 4)], 4),  # the burst's 40 is older than the horizon (2 s) at 2.5 s
    ([(0.0, 40), (0.5, 20), (1.0, 3), (2.2, 2)], 20),  # the 40 expired, the 20 not yet
    ([(0.0, 9), (0.5, 9), (2.2, 1)], 9),  # of equal peaks the newer counts: 9 until 2.5 s
    ([(0.0, 9), (2.0, 1)], 9),  # exactly the horizon old: still in
])
def test_the_live_peak_is_the_most_live_sessions_of_a_step_within_the_horizon(
        steps: list[tuple[float, int]], want: int) -> None:
    clock = Clock()
    alloc = make_allocator("smartspec", AllocationSettings(draft_len=4, max_len=8), SATURATED)
    assert isinstance(alloc, SmartSpecAllocator)
    alloc.wait = DraftWaitModel(clock=clock)
    for when, live in steps:
        clock.now = when
        alloc.assign([rs("spec", 4, 2, context=200)], tracker_with(live))
    assert alloc.peak() == want


def test_a_new_request_is_priced_at_the_recent_peak_not_the_lull() -> None:
    """In a lull one session is live, and priced alone a new request would get a drafter (drafts
    pay only at light load on SATURATED); with 64 live 1 s ago it will likely share the verifier's
    steps with many, where they do not: target-only, until that peak is older than the horizon."""
    clock = Clock()
    alloc, _, _ = warmed(64, clock)
    clock.now = 1.0
    lull = tracker_with(1)
    assert alloc.draft_share(lull) == 0.0
    clock.now = 1.0 + WAIT_HORIZON_S
    assert alloc.draft_share(lull) == 1.0


def test_smartspec_drafts_until_it_has_evidence_and_never_with_max_len_0() -> None:
    fresh = make_allocator("smartspec", AllocationSettings(draft_len=4, max_len=8), SATURATED)
    assert draft_share(fresh, tracker_with(64)) == 1.0  # too few rounds to decide anything yet
    off = make_allocator("smartspec", AllocationSettings(draft_len=0, max_len=0), SATURATED)
    assert draft_share(off, tracker_with(1)) == 0.0


@pytest.mark.parametrize("policy", ["fixed", "random", "goodspeed"])
def test_the_other_policies_always_want_drafts(policy: str) -> None:
    alloc = make_allocator(policy, AllocationSettings(draft_len=4))
    t = tracker_with(64)
    alloc.assign([RoundStats("spec", "d", 4, 0, 200)], t)
    assert draft_share(alloc, t) == 1.0


@pytest.mark.asyncio
async def test_the_verifier_broadcasts_as_soon_as_the_draft_share_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "DRAFT_SHARE_CHECK_S", 0.01)
    monkeypatch.setattr(server, "FLEET_STATUS_EVERY_S", 60.0)
    hub = Hub(make_welcome("target", "fp", 512, 8), "", Routes(4), VerifierMetrics())
    core = SimpleNamespace(draft_share=lambda: 1.0)
    hub.intake = SimpleNamespace(core=core, expire_orphans=lambda: None)  # type: ignore[assignment]
    frontend = Peer("frontend-1", "frontend", "coordinator", "", None)  # type: ignore[arg-type]
    hub.peers[frontend.conn_id] = frontend

    def sent() -> list[float]:
        frames = []
        while not frontend.outbox.empty():
            frame = frontend.outbox.get_nowait()
            assert frame is not None
            frames.append(frame)
        return [msg.draft_share for msg in map(decode, frames) if isinstance(msg, FleetStatus)]

    loop = asyncio.create_task(fleet_status_loop(hub))
    try:
        await asyncio.sleep(0.1)
        assert sent() == []  # nothing changed, and the periodic status is a minute away
        core.draft_share = lambda: 0.0
        await asyncio.sleep(0.1)
        assert sent() == [0.0]
        core.draft_share = lambda: 1.0
        await asyncio.sleep(0.1)
        assert sent() == [1.0]
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


def test_draft_waits_expire_so_a_burst_does_not_keep_speculation_off() -> None:
    """A burst's long waits switch speculation off for a lone new request; once they are older
    than the horizon and nothing newer was measured, drafting is on again, and the core's next
    assign drops them (``test_draft_wait`` expires the load bands' levels)."""
    clock = Clock()
    alloc = make_allocator("smartspec", AllocationSettings(draft_len=4, max_len=8), Linear(4e-3, 0.1e-3))
    alloc.wait = DraftWaitModel(clock=clock)  # type: ignore[attr-defined]
    t = tracker_with(1)
    for _ in range(16):
        alloc.assign([rs("spec", 4, 3, context=200, wait=0.040)], t)  # 40 ms for every draft
    assert alloc.draft_share(t) == 0.0 and not alloc.wait.stale()
    clock.now = WAIT_HORIZON_S + 0.1
    assert alloc.wait.stale() and alloc.draft_share(t) == 1.0
    assert alloc.wait.e0 > 0.03  # still fitted: only the core's thread changes the line
    alloc.assign([rs("spec", 0, 0, context=200)], t)  # a round without a draft measures nothing
    assert alloc.wait.points == deque() and alloc.wait.e0 == alloc.wait.e1 == 0.0


@pytest.mark.parametrize(("drafters", "shares", "want"), [
    ((["d1"], ["d2"]), (0.0, 1.0), 1.0),  # one replica with drafters still wants drafts
    ((["d1"], []), (0.0, 1.0), 0.0),  # the replica that wants them has no drafter to give them to
    (([], []), (0.0, 0.0), 1.0),  # no drafter anywhere: auto sends target-only for that reason alone
])
def test_a_pool_of_replicas_drafts_for_the_largest_share_among_those_with_drafters(
        drafters: tuple[list[str], list[str]], shares: tuple[float, float], want: float) -> None:
    pool = VerifierPool(["ws://127.0.0.1:9/a", "ws://127.0.0.1:9/b"], "c")
    for link, names, share in zip(pool.links, drafters, shares, strict=True):
        link.drafters, link.draft_share = names, share
    assert pool.draft_share == want


@pytest.mark.parametrize(("shares", "want"), [
    ([1.0] * 3, [True] * 3),
    ([0.0] * 3, [False] * 3),
    ([0.25] * 8, [False, False, False, True] * 2),
    ([0.0] * 5 + [1.0, 1.0], [False] * 5 + [True, True]),  # no burst after a spell at 0
    ([0.5, 0.5, 0.0, 0.5, 0.5], [False, True, False, False, True]),
])
def test_an_even_share_takes_every_one_over_share_th_request(shares: list[float], want: list[bool]) -> None:
    share = EvenShare()
    assert [share.take(s) for s in shares] == want
