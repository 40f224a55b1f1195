"""Queued requests go target-only when no drafter is left, or none has room (``--speculation auto``).

``auto`` sends a request to the queue while a drafter is connected to the verifier, else
target-only. A request queued just before the last drafter died or was cut off would otherwise
wait in the queue, with nobody to take it, until a drafter comes back or the request times out.
After ``grace_s`` with no drafter at all (long enough for a restarted drafter to reconnect),
this coordinator opens each of its requests that no one has started yet on the verifier by
itself, the way ``auto`` would have sent them.

Nor does a request wait while every drafter is busy (each serves at most its ``--max-sessions``):
one that no drafter has taken within ``wait_s`` starts target-only too, so the verifier, which batches
target-only sessions beside speculating ones, serves it at once. A drafter that frees up later still
takes its queue entry and drafts for the rest of it (below). Measured at 16 requests on the default
fleet's 2 × 4 drafter sessions, the requests without a drafter had waited for one: a median time to
first token of 4.6 s against target-only serving's 1.0 s, and prompt lookup alone at 0.52x target-only
(`python -m bench edge-drafts`, 2026-12-02 00:34).

With the in-process queue the drafters say, with each pull, how many sessions they can still take
(``QueuePull.room``, and ``QueueRoom`` when sessions end while a pull waits: at the drafter's next
poll, within a second; the queue counts a session's room free already as its last token is
relayed, ``MemoryQueue.note_finished``). A request queued beyond what is left of that room, every drafter being full,
does not wait ``wait_s`` for nothing: it starts target-only at the next tick (every ``ROOM_TICK_S``).
The requests that the drafters' room covers, the first in line, wait for them as before. Measured at
16 requests on the Q4_1 copy alone (one drafter of 4 sessions), the other 12 had started 0.5 s
late: a time to first token of 0.87-1.00 s against target-only serving's 0.35-0.48 s; with the room
counted, 0.36-0.44 s. The default fleet at 16 requests went from 0.93x target-only (TTFT p50
0.58 s) to 1.00x (0.36 s, as target-only's), `python -m bench edge-drafts`, 2026-12-05 14:53.

Nothing is lost, and with one verifier nothing is computed twice: it serves a request id once.
If a drafter opened the request first (its first event has not reached us yet), the verifier
declines our open as a duplicate and the link ignores that. If we were first, a drafter that
takes the queue entry later resumes the session from its committed tokens, or, once it has
finished, is declined as a duplicate and acknowledges the entry. A "busy" refusal leaves the
request waiting for the next try. With several verifier replicas the pool opens it on the least
loaded connected one; if a drafter opens it on another replica meanwhile, both start it and the
routing table cancels the one whose events come second.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from prometheus_client import Counter

from services.coordinator.routing import Routing
from shared.log import get_logger
from shared.protocol import OpenSession

log = get_logger("coordinator.queue_fallback")


class LinkView(Protocol):
    """What the fallback needs of a FrontendLink or VerifierPool."""

    @property
    def connected(self) -> bool: ...
    @property
    def drafters(self) -> list[str]: ...
    @property
    def routing(self) -> Routing: ...
    def open_target_only(self, session: OpenSession) -> None: ...


class QueueRoom(Protocol):
    """What the fallback needs of the in-process queue (``shared.queue_memory.MemoryQueue``)."""

    def room(self) -> int | None: ...
    def waiting_ids(self) -> list[str]: ...


#: how often the fallback looks while it can see the drafters' room: a request beyond it starts
#: at most this late
ROOM_TICK_S = 0.05


class QueueFallback:
    """Watches the fleet; ``tick`` does the work, ``run`` calls it every ``period_s``."""

    def __init__(self, link: LinkView, grace_s: float, wait_s: float = 0.0, period_s: float = 0.5,
                 counter: Counter | None = None, queue: QueueRoom | None = None) -> None:
        self._link = link
        self._counter = counter
        self._queue = queue if wait_s > 0 else None  # wait_s 0: every request waits for a drafter
        self.grace_s, self.wait_s = grace_s, wait_s
        self._period_s = min(period_s, wait_s / 2) if wait_s > 0 else period_s
        if self._queue is not None:
            self._period_s = min(self._period_s, ROOM_TICK_S)
        self._empty_since: float | None = None
        self._queued_at: dict[str, float] = {}  # when each waiting request was first seen waiting

    def tick(self, now: float) -> int:
        """Open target-only the waiting requests once the fleet has been empty for ``grace_s``, or,
        with drafters connected, each that has waited ``wait_s`` for one or is queued beyond the
        room the drafters have left; returns how many now."""
        if not self._link.connected:
            self._empty_since = None
            return 0
        routing = self._link.routing
        # an open places a request; one opened here waits for its first event in fallen_back
        waiting = [rid for rid in routing.subs if rid not in routing.where and rid not in routing.fallen_back]
        self._queued_at = {rid: self._queued_at.get(rid, now) for rid in waiting}
        if self._link.drafters:
            self._empty_since = None
            due = [rid for rid in waiting if now - self._queued_at[rid] >= self.wait_s] if self.wait_s > 0 else []
            due += self._beyond_room(set(waiting) - set(due))
        else:
            if self._empty_since is None:
                self._empty_since = now
            due = waiting if now - self._empty_since >= self.grace_s else []
        sent = self._open(routing, due)
        if sent and not self._link.drafters:
            log.warning("no drafter connected; queued requests served target-only", requests=sent,
                        no_drafter_for_s=round(now - (self._empty_since or now), 1))
        elif sent:
            log.info("every drafter busy; queued requests start target-only until one takes them", requests=sent,
                     wait_s=self.wait_s)
        return sent

    def _beyond_room(self, waiting: set[str]) -> list[str]:
        """The ``waiting`` requests no drafter has room for: those in the queue's line past the
        sessions the drafters can still take (the first in line go to the drafters first)."""
        room = self._queue.room() if self._queue is not None and waiting else None
        if room is None or self._queue is None:
            return []
        return [rid for rid in self._queue.waiting_ids()[room:] if rid in waiting]

    def _open(self, routing: Routing, rids: list[str]) -> int:
        sent = 0
        for frame in routing.ledger.opened(rids):  # no event yet: nobody has started them
            try:
                self._link.open_target_only(frame)
            except ConnectionError:
                break  # the link went down meanwhile: its own resume logic takes over
            routing.fallen_back.add(frame.request_id)
            self._queued_at.pop(frame.request_id, None)
            sent += 1
        if sent and self._counter is not None:
            self._counter.inc(sent)
        return sent

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            self.tick(time.monotonic())
