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

from dataclasses import dataclass
from typing import Protocol

from shared.protocol import QueuedRequest


@dataclass(frozen=True)
class Delivery:
    delivery_id: str  # opaque: the Redis entry id, or a MemoryQueue counter
    request: QueuedRequest


class QueueError(RuntimeError):
    """The queue backend is unreachable or refused an operation; the message says which."""


class RequestQueue(Protocol):
    async def put(self, request: QueuedRequest) -> None:
        """Append a request (producers: the coordinator)."""

    async def get(self, consumer: str, max_items: int = 1, timeout_s: float | None = None) -> list[Delivery]:
        """Up to max_items deliveries for this consumer; waits up to timeout_s (None: forever)
        for at least one; returns [] on timeout."""

    async def ack(self, consumer: str, delivery_id: str) -> None:
        """The request is finished: remove it for good."""

    async def release(self, consumer: str) -> None:
        """The consumer is gone: make its unacknowledged deliveries available again."""

    async def depth(self) -> int:
        """Requests waiting for a consumer (not yet delivered)."""

    async def close(self) -> None: ...
