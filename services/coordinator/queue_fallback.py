"""Queued requests go target-only when no drafter is left (``--speculation auto``).

``auto`` sends a request to the queue while a drafter is connected to the verifier, else
target-only. A request queued just before the last drafter died or was cut off would otherwise
wait in the queue, with nobody to take it, until a drafter comes back or the request times out.
After ``grace_s`` with no drafter at all (long enough for a restarted drafter to reconnect),
this coordinator opens each of its requests that no one has started yet on the verifier by
itself, the way ``auto`` would have sent them.

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


class QueueFallback:
    """Watches the fleet; ``tick`` does the work, ``run`` calls it every ``period_s``."""

    def __init__(self, link: LinkView, grace_s: float, period_s: float = 0.5,
                 counter: Counter | None = None) -> None:
        self._link = link
        self._counter = counter
        self.grace_s = grace_s
        self._period_s = period_s
        self._empty_since: float | None = None

    def tick(self, now: float) -> int:
        """Open the waiting requests target-only once the fleet has been empty for ``grace_s``;
        returns how many were opened now."""
        if not self._link.connected or self._link.drafters:
            self._empty_since = None
            return 0
        if self._empty_since is None:
            self._empty_since = now
        if now - self._empty_since < self.grace_s:
            return 0
        routing = self._link.routing
        waiting = [rid for rid in routing.subs if rid not in routing.where]  # an open places a request
        sent = 0
        for frame in routing.ledger.opened(waiting):  # no event yet: nobody has started them
            try:
                self._link.open_target_only(frame)
            except ConnectionError:
                break  # the link went down meanwhile: its own resume logic takes over
            routing.fallen_back.add(frame.request_id)
            sent += 1
        if sent:
            if self._counter is not None:
                self._counter.inc(sent)
            log.warning("no drafter connected; queued requests served target-only", requests=sent,
                        no_drafter_for_s=round(now - self._empty_since, 1))
        return sent

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            self.tick(time.monotonic())
