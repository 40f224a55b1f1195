"""A coordinator's requests in flight, shared by its links to the verifier replicas.

Per request: the queue its handler reads events from (:class:`Inbound`), what was relayed of
it (``resume.py``, to re-open it on another verifier), and the replica serving it. A request's
replica is fixed by the first event that arrives for it (a drafter opened it there) or by a
target-only open; events for it from any other replica are dropped and cancelled there
(session affinity: its KV cache and committed text live on one verifier).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from services.coordinator.resume import ResumeLedger
from shared.protocol import Adopted, OpenSession, TokenEvent


@dataclass(frozen=True, slots=True)
class Inbound:
    """One TokenEvent for a subscriber. ``arrived``: ``time.perf_counter()`` when its frame came in
    from the verifier. ``code``: the verifier's ErrorFrame code when the event stands for one
    (e.g. "busy": its sessions or KV cache are full), else empty."""

    event: TokenEvent
    arrived: float
    code: str = ""


@dataclass
class Routing:
    replicas: int = 1
    subs: dict[str, asyncio.Queue[Inbound]] = field(default_factory=dict)
    ledger: ResumeLedger = field(default_factory=ResumeLedger)
    where: dict[str, int] = field(default_factory=dict)  # request id -> replica index
    #: queued requests this coordinator opened target-only itself (``queue_fallback.py``)
    fallen_back: set[str] = field(default_factory=set)
    #: Adopt frames sent, by (request id, replica index): the future their Adopted answer resolves
    adopting: dict[tuple[str, int], asyncio.Future[Adopted]] = field(default_factory=dict)
    #: called with a request's id as its last event is relayed (the in-process queue's note_finished)
    on_finished: Callable[[str], None] | None = None

    def subscribe(self, request_id: str, opened: OpenSession | None) -> asyncio.Queue[Inbound]:
        if request_id in self.subs:
            raise ValueError(f"request id {request_id!r} is already subscribed")
        queue: asyncio.Queue[Inbound] = asyncio.Queue()
        self.subs[request_id] = queue
        if opened is not None:
            self.ledger.track(opened)
        return queue

    def forget(self, request_id: str, queue: asyncio.Queue[Inbound] | None = None) -> asyncio.Queue[Inbound] | None:
        """Drop the request (only if ``queue``, when given, is still its subscriber's)."""
        if queue is not None and self.subs.get(request_id) is not queue:
            return None
        self.ledger.forget(request_id)
        self.where.pop(request_id, None)
        self.fallen_back.discard(request_id)
        return self.subs.pop(request_id, None)

    def owned_by(self, request_id: str, replica: int) -> bool:
        """Whether ``replica`` serves the request: it was placed there, or it is not placed yet
        and there is only one replica (which then serves everything)."""
        placed = self.where.get(request_id)
        return placed == replica if placed is not None else self.replicas == 1

    def claim(self, request_id: str, replica: int) -> bool:
        """An event for the request came from ``replica``: place it there if it is not placed yet;
        True when ``replica`` serves it."""
        return self.where.setdefault(request_id, replica) == replica

    def relayed(self, event: TokenEvent) -> None:
        self.ledger.relayed(event)
        if event.finished:
            self.where.pop(event.request_id, None)
            if self.on_finished is not None:
                self.on_finished(event.request_id)

    def declined_fallback(self, request_id: str, code: str) -> bool:
        """Whether an error for ``request_id`` only declines this coordinator's target-only open of
        a queued request: "duplicate" (a drafter opened it first; its events will come) or "busy"
        (it keeps waiting and is tried again)."""
        if request_id not in self.fallen_back or code not in ("duplicate", "busy"):
            return False
        if code == "busy":  # not served: back to waiting
            self.fallen_back.discard(request_id)
            self.where.pop(request_id, None)
        return True

    def of(self, replica: int) -> list[str]:
        """The requests ``replica`` serves (see :meth:`owned_by`)."""
        return [rid for rid in self.subs if self.owned_by(rid, replica)]
