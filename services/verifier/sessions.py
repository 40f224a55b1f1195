"""The event loop's view of each session: whom to tell, its text so far, its counts.

The engine core owns the tokens and the KV cache; this side owns everything that reaches a
peer: which drafter connection gets the per-round Verdicts, which frontend gets the
TokenEvents, the incremental text with its stop strings, and the request ids already served
(a re-delivered request is answered "duplicate").

With ``keep_s`` > 0 (``--orphan-grace-s``) it also keeps what a client's stream needs to move to
another coordinator: each request's events so far; a request whose coordinator left (an
*orphan*, relayed to nobody) for up to ``keep_s``; a finished request's events for ``keep_s``; and
the adopter of a request not opened here yet.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from services.verifier.detok import IncrementalText
from shared.protocol import TokenEvent

#: the origin of a request no coordinator relays (an orphan's ``Route.origin``)
ORPHAN = ""
#: finished request ids remembered, so a re-delivered request is answered "duplicate"
FINISHED_IDS_KEPT = 100_000
#: finished requests whose events are kept for a resume (each at most ``keep_s``), oldest dropped
#: first, and the most events kept over all of them (a few hundred bytes each)
FINISHED_KEPT = 10_000
FINISHED_EVENTS_KEPT = 500_000


@dataclass
class Route:
    request_id: str
    origin: str  # the frontend node that receives TokenEvents ("": nobody, an orphan)
    opener: str  # the connection that sent OpenSession
    drafter: str | None  # connection that gets per-round Verdicts; None when target-only
    owner: str | None  # the drafter connection that opened it: told when it finishes
    prompt_tokens: int
    text: IncrementalText
    # counted as its rounds come back
    completion_tokens: int = field(init=False, default=0)
    drafted: int = field(init=False, default=0)
    accepted: int = field(init=False, default=0)
    seq: int = field(init=False, default=0)  # of the last TokenEvent sent
    history: list[TokenEvent] = field(init=False, default_factory=list)  # every event so far (keep_s > 0)
    orphaned_at: float | None = field(init=False, default=None)  # when it lost its coordinator


@dataclass(frozen=True)
class Kept:
    """A finished request's events, kept until ``until`` (``time.monotonic()``)."""

    until: float
    events: list[TokenEvent]


class Routes:
    def __init__(self, max_sessions: int, keep_s: float = 0.0) -> None:
        self.max_sessions = max_sessions
        self.keep_s = keep_s
        self.open: dict[str, Route] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self.kept: OrderedDict[str, Kept] = OrderedDict()
        self._kept_events = 0
        self.adopters: dict[str, tuple[str, float]] = {}  # request id not opened yet -> (adopter, until)

    def __len__(self) -> int:
        return len(self.open)

    def get(self, request_id: str) -> Route | None:
        return self.open.get(request_id)

    def known(self, request_id: str) -> bool:
        return request_id in self.open or request_id in self._finished

    def add(self, route: Route) -> None:
        self.open[route.request_id] = route

    def close(self, request_id: str) -> None:
        route = self.open.pop(request_id, None)
        if route is None:
            return
        self._finished[request_id] = None
        while len(self._finished) > FINISHED_IDS_KEPT:
            self._finished.popitem(last=False)
        if self.keep_s > 0 and route.history:  # one refused before any event ("busy") has nothing to replay
            self.kept[request_id] = Kept(time.monotonic() + self.keep_s, route.history)
            self._kept_events += len(route.history)
            while len(self.kept) > FINISHED_KEPT or self._kept_events > FINISHED_EVENTS_KEPT:
                self._forget_oldest()

    def _forget_oldest(self) -> None:
        self._kept_events -= len(self.kept.popitem(last=False)[1].events)

    def replay(self, request_id: str) -> list[TokenEvent] | None:
        """The kept events of a finished request (None: not kept)."""
        kept = self.kept.get(request_id)
        return kept.events if kept is not None else None

    def await_adopter(self, request_id: str, node_id: str) -> None:
        """A coordinator adopted a request not opened here yet: route it there once it is."""
        self.adopters[request_id] = (node_id, time.monotonic() + self.keep_s)

    def adopter(self, request_id: str) -> str | None:
        """The coordinator that adopted ``request_id`` before it was opened (forgotten now), if any."""
        found = self.adopters.pop(request_id, None)
        return found[0] if found is not None else None

    def orphan(self, route: Route) -> None:
        """Nobody relays ``route`` any more; it runs on (events kept) until adopted or expired."""
        route.origin, route.orphaned_at = ORPHAN, time.monotonic()

    def adopt(self, route: Route, node_id: str) -> None:
        route.origin, route.orphaned_at = node_id, None

    def expired(self) -> list[Route]:
        """Forget kept events and adopters past their time; the orphans past ``keep_s`` (to cancel)."""
        now = time.monotonic()
        while self.kept and next(iter(self.kept.values())).until <= now:
            self._forget_oldest()
        for rid in [rid for rid, (_, until) in self.adopters.items() if until <= now]:
            del self.adopters[rid]
        return [r for r in self.open.values() if r.orphaned_at is not None and now - r.orphaned_at >= self.keep_s]

    def of_conn(self, conn_id: str) -> list[Route]:
        return [r for r in self.open.values() if conn_id in (r.drafter, r.owner)]

    def of_origin(self, origin: str) -> list[Route]:
        """The open requests a coordinator sent (whose clients it relays to)."""
        return [r for r in self.open.values() if r.origin == origin]
