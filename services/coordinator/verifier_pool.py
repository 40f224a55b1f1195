"""Several verifier replicas behind one coordinator (``--verifier-url`` with a comma list).

Each replica gets its own :class:`FrontendLink`; they share one :class:`Routing`, so a request
is served by exactly one replica (session affinity): the one a drafter opened it on (drafters
connect to a replica each and pull from the shared queue, which balances the load), or, for a
target-only request, the connected replica holding the fewest sessions.

When a replica's link goes down, the requests it was serving fail over at once to a connected
replica: each is re-opened there from what this coordinator relayed (``resume.py``), exactly as
after a verifier restart, and its client's stream goes on. (The lost replica, if it is still
alive, cancels them itself: a verifier cancels the requests of a coordinator whose link
closed.) With no other replica connected, they wait for the lost one to come back, as with a
single verifier. Replicas are independent verifiers: they do not share KV caches.
"""

from __future__ import annotations

import asyncio
import ssl

from services.coordinator.routing import Inbound, Routing
from services.coordinator.verifier_link import Backoff, FrontendLink, Replica
from shared.log import get_logger
from shared.protocol import Cancel, OpenSession, Welcome

log = get_logger("coordinator.verifier_pool")


class VerifierPool:
    """The coordinator's links to every verifier replica, with the interface of one link."""

    def __init__(self, urls: list[str], node_id: str, auth_token: str = "", tokenizer_fingerprint: str = "",
                 tls: ssl.SSLContext | None = None, min_backoff_s: float = 0.1) -> None:
        if not urls:
            raise ValueError("at least one verifier URL is needed")
        self.node_id = node_id
        self._routing = Routing(replicas=len(urls))
        self._stopping = False
        backoff = Backoff(min_s=min_backoff_s)
        self.links = [FrontendLink(url, node_id, auth_token, tokenizer_fingerprint, backoff=backoff, tls=tls,
                                   replica=Replica(self._routing, i, self._fail_over))
                      for i, url in enumerate(urls)]

    # --- the link interface ---------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return any(link.connected for link in self.links)

    @property
    def routing(self) -> Routing:
        return self._routing

    @property
    def last_error(self) -> str:
        return "; ".join(f"{link.url}: {link.last_error}" for link in self.links if not link.connected)

    @property
    def drafters(self) -> list[str]:
        return sorted({d for link in self.links for d in link.drafters})

    @property
    def draft_share(self) -> float:
        """The largest share of new requests a replica with drafters wants drafted for."""
        return max((link.draft_share for link in self.links if link.drafters), default=1.0)

    @property
    def sessions(self) -> int:
        return sum(link.sessions for link in self.links)

    @property
    def welcome(self) -> Welcome | None:
        return next((link.welcome for link in self.links if link.welcome is not None), None)

    @property
    def max_model_len(self) -> int:
        """The smallest context limit of the connected replicas (any of them may serve a request)."""
        limits = [link.max_model_len for link in self.links if link.connected and link.max_model_len]
        return min(limits) if limits else max(link.max_model_len for link in self.links)

    def subscribe(self, request_id: str, opened: OpenSession | None = None) -> asyncio.Queue[Inbound]:
        return self._routing.subscribe(request_id, opened)

    def unsubscribe(self, request_id: str, queue: asyncio.Queue[Inbound] | None = None) -> None:
        self._routing.forget(request_id, queue)

    @property
    def welcomed(self) -> bool:
        return any(link.welcomed for link in self.links)

    @property
    def grace_s(self) -> float:
        return min((link.grace_s for link in self.links if link.welcomed), default=0.0)

    def release_nowait(self, request_id: str) -> None:
        """Release on the replica serving the request (on every connected one while none does yet)."""
        placed = self._routing.where.get(request_id)
        for link in self.links if placed is None else [self.links[placed]]:
            link.release_nowait(request_id)

    def cancel_nowait(self, request_id: str) -> None:
        """Cancel on the replica serving the request; on every connected one while none does yet
        (a drafter may be opening it anywhere)."""
        placed = self._routing.where.get(request_id)
        for link in self.links if placed is None else [self.links[placed]]:
            link.send(Cancel(request_id=request_id))

    async def cancel(self, request_id: str) -> None:
        self.cancel_nowait(request_id)

    def open_target_only(self, session: OpenSession) -> None:
        """Open on the connected replica holding the fewest sessions. Raises when none is connected."""
        live = [link for link in self.links if link.connected]
        if not live:
            raise ConnectionError(f"no verifier replica is connected ({self.last_error})")
        min(live, key=lambda link: link.sessions).open_target_only(session)

    async def wait_connected(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                while not self.connected:
                    await asyncio.sleep(0.05)
        except TimeoutError:
            return False
        return True

    async def start(self) -> None:
        for link in self.links:
            await link.start()

    async def stop(self) -> None:
        self._stopping = True  # links going down now must not move their requests to the ones still up
        for link in self.links:
            await link.stop()

    # --- failover -------------------------------------------------------------------------

    def _fail_over(self, lost: int) -> None:
        """Replica ``lost``'s link went down: re-open its requests on a connected replica."""
        if self._stopping:
            return
        live = [link for link in self.links if link.connected and link.index != lost]
        moving = [rid for rid in self._routing.of(lost) if rid in self._routing.ledger]
        if not live or not moving:
            return
        target = min(live, key=lambda link: link.sessions)
        for frame in self._routing.ledger.reopen(moving):
            self._routing.where[frame.request_id] = target.index
            target.send(frame)
        log.warning("verifier replica lost; its requests failed over", lost=self.links[lost].url,
                    to=target.url, requests=len(moving))
