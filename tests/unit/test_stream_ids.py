"""Resumable streams' positions and event ids (services/coordinator/stream_ids.py), the SSE
chunks a resume skips, and the verifier's keeping of orphans (services/verifier/sessions.py)."""

from __future__ import annotations

import time

import pytest

from services.coordinator.stream import Positions
from services.coordinator.stream_ids import (
    BadEventId,
    event_id,
    finish_pos,
    last_position,
    parse_event_id,
    text_pos,
    usage_pos,
)
from services.verifier.detok import IncrementalText
from services.verifier.sessions import Route, Routes
from shared.protocol import TokenEvent

RID = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(("value", "rid", "positions"), [
    (f"{RID}.0", RID, [0]),
    (f"{RID}.14", RID, [14]),
    (f" {RID}.3 ", RID, [3]),
    (f"chatcmpl-{RID}.7", RID, [7]),
    (f"cmpl-{RID}.2.-1.9", RID, [2, -1, 9]),
])
def test_event_ids_parse(value: str, rid: str, positions: list[int]) -> None:
    assert parse_event_id(value) == (rid, positions)


@pytest.mark.parametrize("value", [
    "", "hello", RID, f"{RID}.", f"{RID}.x", f"{RID}.-2", f"{RID[:-1]}.3", f"{RID.upper()}.3",
    f"{RID}.3;drop", f"{RID}.1234567890123", f"{RID}" + ".1" * 129, "\x00" * 40,
])
def test_garbage_is_refused_with_a_reason(value: str) -> None:
    with pytest.raises(BadEventId, match="Last-Event-ID"):
        parse_event_id(value)


@pytest.mark.parametrize("positions", [[0], [5], [-1, 3], [2, 2, 2]])
def test_event_ids_round_trip(positions: list[int]) -> None:
    assert parse_event_id(event_id(RID, positions)) == (RID, positions)


@pytest.mark.parametrize(("state", "last_seq", "choice", "furthest"), [
    ("live", 0, 0, 1),  # nothing generated yet: the role and echo chunks at most
    ("unknown", 0, 0, 1),
    ("live", 4, 0, text_pos(4)),  # the final event has not come
    ("finished", 4, 0, usage_pos(4)),  # choice 0 carries the usage chunk
    ("finished", 4, 1, finish_pos(4)),
])
def test_the_furthest_position_a_client_can_hold(state: str, last_seq: int, choice: int, furthest: int) -> None:
    assert last_position(state, last_seq, choice) == furthest


def test_positions_are_ordered_within_and_across_events() -> None:
    order = [0, 1, text_pos(1), text_pos(2), finish_pos(2), usage_pos(2)]
    assert order == sorted(order) and len(set(order)) == len(order)


def test_a_resume_sends_only_what_the_client_lacks_with_ids_of_every_choice() -> None:
    at = Positions(RID, 2, after=[text_pos(1), -1])
    assert at.chunk(0, text_pos(1), lambda: {"x": 1}) is None  # the client has it
    sent = at.chunk(0, text_pos(2), lambda: {"x": 2})
    assert sent == f"id: {RID}.4.-1\ndata: {{\"x\":2}}\n\n".encode()
    assert at.chunk(1, 0, lambda: {"x": 3}) == f"id: {RID}.4.0\ndata: {{\"x\":3}}\n\n".encode()


def _route(rid: str, origin: str = "a") -> Route:
    return Route(rid, origin, "frontend-1", None, None, 3, IncrementalText(None, []))  # type: ignore[arg-type]


def _event(rid: str, seq: int) -> TokenEvent:
    return TokenEvent(request_id=rid, origin="a", token_ids=[seq], text=str(seq), seq=seq)


def test_routes_keep_a_finished_requests_events_for_the_grace_then_forget_them() -> None:
    routes = Routes(4, keep_s=0.05)
    route = _route("r1")
    routes.add(route)
    route.history += [_event("r1", 1), _event("r1", 2)]
    routes.close("r1")
    assert [e.seq for e in routes.replay("r1") or []] == [1, 2] and routes.known("r1")
    time.sleep(0.06)
    assert routes.expired() == [] and routes.replay("r1") is None and routes.known("r1")


def test_routes_without_a_grace_keep_nothing() -> None:
    routes = Routes(4)
    routes.add(_route("r1"))
    routes.close("r1")
    assert not routes.kept


def test_an_orphan_expires_after_the_grace_unless_adopted() -> None:
    routes = Routes(4, keep_s=0.05)
    lost, saved = _route("lost"), _route("saved")
    routes.add(lost)
    routes.add(saved)
    routes.orphan(lost)
    routes.orphan(saved)
    assert lost.origin == saved.origin == ""
    routes.adopt(saved, "b")
    routes.await_adopter("queued", "b")
    assert routes.expired() == []  # not yet
    time.sleep(0.06)
    assert routes.expired() == [lost] and saved.origin == "b" and routes.adopter("queued") is None


def test_routes_bound_the_events_they_keep(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.verifier.sessions as sessions

    monkeypatch.setattr(sessions, "FINISHED_EVENTS_KEPT", 5)
    routes = Routes(8, keep_s=60)
    for rid in ("a", "b", "c"):
        route = _route(rid)
        routes.add(route)
        route.history += [_event(rid, 1), _event(rid, 2)]
        routes.close(rid)
    assert list(routes.kept) == ["b", "c"]  # 6 events > 5: the oldest request's are forgotten
