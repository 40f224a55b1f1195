"""The request queue: one interface, three transports.

* ``MemoryQueue``       in-process (the coordinator's default when no Redis is configured)
* ``RedisStreamQueue``  Redis Streams + a consumer group: XADD / XREADGROUP / XACK, with
                        XAUTOCLAIM so requests left pending by a dead drafter are re-delivered
* ``QueueLinkClient``   a drafter's consumer view of a coordinator's MemoryQueue, over the
                        coordinator's ``/internal/queue`` WebSocket (QueuePull / QueueDelivery / QueueAck)

Delivery is at-least-once: a request is removed only when its consumer ACKs it (after the
request finished), and a consumer that goes away has its unacknowledged requests re-delivered.

``open_queue(url, ...)`` picks the transport from the URL scheme: ``redis://``/``rediss://``,
``ws://``/``wss://`` or ``memory://``.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Protocol

from shared.protocol import QueuedRequest


@dataclass(frozen=True)
class Delivery:
    delivery_id: str  # opaque: the Redis entry id, or a MemoryQueue counter
    request: QueuedRequest


class QueueError(RuntimeError):
    """The queue backend is unreachable or refused an operation; the message says which."""


class QueueFull(QueueError):
    """``put`` refused: the queue already holds its maximum number of waiting requests. Unlike
    other QueueErrors this is transient: retry once consumers have taken some."""


class RequestQueue(Protocol):
    async def put(self, request: QueuedRequest) -> None:
        """Append a request (producers: the coordinator); QueueFull when a bounded queue is full."""

    async def get(self, consumer: str, max_items: int = 1, timeout_s: float | None = None,
                  room: int = 0) -> list[Delivery]:
        """Up to max_items deliveries for this consumer; waits up to timeout_s (None: forever)
        for at least one; returns [] on timeout. ``room``: the sessions the consumer can still
        take, this call's included (0: not said); the in-process queue counts it, so that its
        coordinator starts a request no drafter has room for at once (Redis ignores it)."""

    async def ack(self, consumer: str, delivery_id: str) -> None:
        """The request is finished: remove it for good."""

    async def release(self, consumer: str) -> None:
        """The consumer is gone: make its unacknowledged deliveries available again."""

    async def depth(self) -> int:
        """Requests waiting for a consumer (not yet delivered)."""

    async def close(self) -> None: ...


def open_queue(
    url: str,
    *,
    stream: str = "specfleet:requests",
    group: str = "drafters",
    auth_token: str = "",
    claim_idle_ms: int = 30000,
    tls: ssl.SSLContext | None = None,
    site: str = "",
) -> RequestQueue:
    """The queue transport for ``url`` (no I/O here: each transport connects on first use).

    ``memory://`` makes a new in-process queue; ``redis://``/``rediss://``/``unix://`` a Redis
    Streams queue on ``stream`` read through ``group``; ``ws://``/``wss://`` a consumer link to a
    coordinator's ``/internal/queue`` (authenticated with ``auth_token``; ``site``: the machine the
    consumer drafts on, see ``shared/queue_memory.py``).
    """
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme == "memory":
        from shared.queue_memory import MemoryQueue

        return MemoryQueue()
    if scheme in ("redis", "rediss", "unix"):
        from shared.queue_redis import RedisStreamQueue

        return RedisStreamQueue(url, stream=stream, group=group, claim_idle_ms=claim_idle_ms)
    if scheme in ("ws", "wss"):
        from shared.queue_link import QueueLinkClient

        return QueueLinkClient(url, auth_token, tls=tls, site=site)
    raise QueueError(
        f"unsupported queue URL {url!r}: use redis://host:6379/0 (Redis Streams), "
        "ws://coordinator:8000/internal/queue (the coordinator's queue link) or memory:// (in-process)"
    )
