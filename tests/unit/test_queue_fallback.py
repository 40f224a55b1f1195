"""QueueFallback: queued requests go target-only only after the fleet has had no drafter for the
grace period, each at most once, and a verifier's "duplicate" or "busy" answer to such an open
never fails the request."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.coordinator.queue_fallback import QueueFallback
from services.coordinator.routing import Routing
from shared.protocol import OpenSession, SamplingParams

GRACE = 5.0


@dataclass
class Link:
    """The part of a FrontendLink the fallback uses, with a real Routing."""

    connected: bool = True
    drafters: list[str] = field(default_factory=list)
    routing: Routing = field(default_factory=Routing)
    opened: list[str] = field(default_factory=list)

    def open_target_only(self, session: OpenSession) -> None:
        if not self.connected:
            raise ConnectionError("down")
        assert not session.speculative
        self.routing.where[session.request_id] = 0
        self.opened.append(session.request_id)


def queue(link: Link, *rids: str) -> None:
    for rid in rids:
        link.routing.subscribe(rid, OpenSession(request_id=rid, prompt_ids=[1, 2], params=SamplingParams(),
                                                origin="c", speculative=False))


def test_nothing_moves_while_a_drafter_is_connected_and_busy_waits_are_off() -> None:
    link = Link(drafters=["d1"])
    queue(link, "a")
    fallback = QueueFallback(link, GRACE)
    assert [fallback.tick(t) for t in (0.0, 10.0, 100.0)] == [0, 0, 0]


def test_a_request_no_busy_drafter_takes_within_the_wait_starts_target_only_once() -> None:
    link = Link(drafters=["d1"])
    fallback = QueueFallback(link, GRACE, wait_s=0.5)
    queue(link, "a")
    assert [fallback.tick(t) for t in (10.0, 10.4)] == [0, 0]  # first seen waiting at 10.0
    queue(link, "b")
    assert fallback.tick(10.5) == 1 and link.opened == ["a"]  # "b" has waited 0 s so far
    assert [fallback.tick(t) for t in (10.6, 11.0, 20.0)] == [0, 1, 0] and link.opened == ["a", "b"]


@dataclass
class Line:
    """The in-process queue's view: the drafters' room left and the requests not yet delivered."""

    left: int | None
    ids: list[str] = field(default_factory=list)

    def room(self) -> int | None:
        return self.left

    def waiting_ids(self) -> list[str]:
        return self.ids


@pytest.mark.parametrize(("left", "at_once"), [
    (None, []),  # the drafters' room unknown: every request waits --queue-wait-s
    (3, []),  # room for all three
    (1, ["b", "c"]),  # the first in line waits for the drafter, the others start now
    (0, ["a", "b", "c"]),  # every drafter full
])
def test_requests_beyond_the_drafters_room_start_target_only_at_once(left: int | None, at_once: list[str]) -> None:
    link = Link(drafters=["d1"])
    queue(link, "a", "b", "c")
    fallback = QueueFallback(link, GRACE, wait_s=0.5, queue=Line(left, ["a", "b", "c"]))
    assert fallback.tick(10.0) == len(at_once) and link.opened == at_once
    assert fallback.tick(10.5) == 3 - len(at_once)  # the rest after the wait, as before
    assert sorted(link.opened) == ["a", "b", "c"]


def test_a_request_taken_over_is_not_counted_against_the_room() -> None:
    link = Link(drafters=["d1"])
    queue(link, "a", "b")
    line = Line(0, ["a", "b"])
    fallback = QueueFallback(link, GRACE, wait_s=0.5, queue=line)
    assert fallback.tick(0.0) == 2
    line.left = 1  # a drafter frees up: it takes "a", started target-only, first in line
    queue(link, "c")
    line.ids = ["a", "b", "c"]
    assert fallback.tick(0.05) == 1 and link.opened == ["a", "b", "c"]  # past the room: c starts too


def test_waiting_for_a_drafter_ignores_the_room() -> None:
    link = Link(drafters=["d1"])
    queue(link, "a")
    fallback = QueueFallback(link, GRACE, wait_s=0.0, queue=Line(0, ["a"]))  # --queue-wait-s 0
    assert [fallback.tick(t) for t in (0.0, 10.0)] == [0, 0]


def test_a_request_a_drafter_took_is_not_opened_again() -> None:
    link = Link(drafters=["d1"])
    fallback = QueueFallback(link, GRACE, wait_s=0.5)
    queue(link, "a")
    fallback.tick(0.0)
    link.routing.claim("a", 0)  # its first event came: a drafter opened it
    assert fallback.tick(5.0) == 0 and link.opened == []


@pytest.mark.parametrize(("ticks", "moved"), [
    ([0.0, 4.9], [0, 0]),  # not yet past the grace
    ([0.0, 5.0], [0, 1]),
    ([0.0, 5.0, 6.0, 60.0], [0, 1, 0, 0]),  # each request once
])
def test_waiting_requests_move_after_the_grace(ticks: list[float], moved: list[int]) -> None:
    link = Link()
    queue(link, "a")
    fallback = QueueFallback(link, GRACE)
    assert [fallback.tick(t) for t in ticks] == moved


def test_a_drafter_coming_back_restarts_the_grace() -> None:
    link = Link()
    queue(link, "a")
    fallback = QueueFallback(link, GRACE)
    fallback.tick(0.0)
    link.drafters = ["d1"]
    fallback.tick(3.0)
    link.drafters = []
    assert fallback.tick(4.0) == 0 and fallback.tick(8.9) == 0 and fallback.tick(9.0) == 1


def test_only_requests_nobody_started_move() -> None:
    link = Link()
    queue(link, "queued", "drafting", "target-only")
    link.routing.claim("drafting", 0)  # its first event came: a drafter opened it
    link.routing.where["target-only"] = 0  # sent target-only at submission
    fallback = QueueFallback(link, GRACE)
    fallback.tick(0.0)
    assert fallback.tick(GRACE) == 1 and link.opened == ["queued"]


def test_link_down_moves_nothing() -> None:
    link = Link(connected=False)
    queue(link, "a")
    fallback = QueueFallback(link, GRACE)
    assert fallback.tick(0.0) == 0 and fallback.tick(GRACE) == 0


@pytest.mark.parametrize(("code", "declined", "retried"), [
    ("duplicate", True, False),  # a drafter opened it first: its events will come
    ("busy", True, True),  # not served yet: tried again at the next tick
    ("invalid", False, False),  # a real refusal ends the request
])
def test_answers_to_a_fallback_open(code: str, declined: bool, retried: bool) -> None:
    link = Link()
    queue(link, "a")
    fallback = QueueFallback(link, GRACE)
    fallback.tick(0.0)
    fallback.tick(GRACE)
    assert link.routing.declined_fallback("a", code) is declined
    assert fallback.tick(GRACE + 1) == (1 if retried else 0)


def test_errors_for_other_requests_are_not_declines() -> None:
    routing = Routing()
    assert not routing.declined_fallback("never-opened", "duplicate")


def test_forget_clears_the_mark() -> None:
    link = Link()
    queue(link, "a")
    fallback = QueueFallback(link, GRACE)
    fallback.tick(0.0)
    fallback.tick(GRACE)
    link.routing.forget("a")
    assert "a" not in link.routing.fallen_back
