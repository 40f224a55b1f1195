"""SmartSpec per drafter (the verifier's default allocation): each drafter's sessions get the length
its own acceptance and draft waits pay for, a poor drafter's nothing; new requests are wanted drafted
for while a drafter heard from lately finds drafts worth it; and the drafters remembered are bounded."""

from __future__ import annotations

import pytest

from services.verifier.allocation import AllocationSettings, GoodputTracker, PerDrafterAllocator, make_allocator
from services.verifier.allocation import per_drafter as module
from services.verifier.allocation.draft_wait import WAIT_HORIZON_S, DraftWaitModel
from services.verifier.allocation.per_drafter import SHARE_HORIZON_S
from tests.unit.test_allocation import Linear, rs
from tests.unit.test_drafting_switch import Clock

#: a verifier whose step costs about the same for one token or nine: drafts pay when accepted
IDLE = Linear(8e-3, 0.1e-3)


def per_drafter(clock: Clock | None = None) -> PerDrafterAllocator:
    alloc = make_allocator("smartspec-per-drafter", AllocationSettings(draft_len=4, max_len=8), IDLE)
    assert isinstance(alloc, PerDrafterAllocator)
    if clock is not None:
        make = alloc._make

        def timed() -> object:
            inner = make()
            inner.wait = DraftWaitModel(clock=clock)
            return inner

        alloc._make, alloc.clock = timed, clock  # type: ignore[assignment]
    return alloc


def tracker(*sessions: tuple[str, str]) -> GoodputTracker:
    t = GoodputTracker()
    for sid, drafter in sessions:
        t.open(sid, drafter)
    return t


def test_a_good_drafter_gets_long_drafts_and_a_poor_one_none() -> None:
    alloc = per_drafter()
    t = tracker(("good-session", "good"), ("poor-session", "poor"))
    for _ in range(20):  # past SmartSpec's window of evidence
        ks = alloc.assign([rs("good-session", 4, 4, drafter="good", context=200),
                           rs("poor-session", 4, 0, drafter="poor", context=200)], t)
    assert ks["good-session"] >= 6 and ks["poor-session"] == 0
    beliefs = alloc.beliefs()
    assert beliefs["alpha.good"] > 0.9 and beliefs["alpha.poor"] < 0.1 and beliefs["k.poor"] == 0
    # one SmartSpec over both (the paper's global rate) gives both the same length
    shared = make_allocator("smartspec", AllocationSettings(draft_len=4, max_len=8), IDLE)
    for _ in range(20):
        both = shared.assign([rs("good-session", 4, 4, drafter="good", context=200),
                              rs("poor-session", 4, 0, drafter="poor", context=200)], t)
    assert both["good-session"] == both["poor-session"]


def test_a_new_session_starts_from_its_drafters_length() -> None:
    alloc = per_drafter()
    t = tracker(("s1", "good"))
    for _ in range(20):
        alloc.assign([rs("s1", 4, 4, drafter="good", context=200)], t)
    t.open("s2", "good")
    t.open("lone", None)
    assert alloc.initial("s2", t) == alloc.drafters["good"].last_k >= 6
    assert alloc.initial("lone", t) == 4 and "" not in alloc.drafters  # no drafter: the first length, no estimator


def test_new_requests_are_drafted_for_while_a_drafter_heard_from_lately_finds_it_worth_it() -> None:
    clock = Clock()
    alloc = per_drafter(clock)
    t = tracker(("poor-session", "poor"))
    for _ in range(20):
        alloc.assign([rs("poor-session", 4, 0, drafter="poor", context=200)], t)
    assert alloc.draft_share(t) == 0.0  # the only drafter's drafts cost more than they save
    clock.now += WAIT_HORIZON_S + 1  # its sessions draft nothing, so no round of it reaches the estimator...
    assert alloc.draft_share(t) == 0.0  # ... and its acceptance still keeps new requests target-only
    clock.now += SHARE_HORIZON_S  # a drafter not heard from for a minute no longer speaks for new requests
    assert alloc.draft_share(t) == 1.0


def test_the_drafters_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "MAX_DRAFTERS", 3)
    alloc = per_drafter()
    t = tracker(*[(f"s{i}", f"d{i}") for i in range(5)])
    for i in range(5):
        alloc.assign([rs(f"s{i}", 4, 2, drafter=f"d{i}")], t)
    assert list(alloc.drafters) == ["d2", "d3", "d4"]  # the least recently heard from went first
