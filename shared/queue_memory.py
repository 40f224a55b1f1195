"""The in-process request queue: the coordinator's queue when no Redis is configured.

Drafters reach it over the coordinator's ``/internal/queue`` WebSocket (see
``services/coordinator/queue_link.py`` and ``shared/queue_link.py``); the coordinator itself
puts requests in directly.

Semantics match the Redis transport so that drafters cannot tell them apart:

* FIFO; a delivery keeps its id for life, also when it is re-delivered (like a stream entry id).
  Ids are unique to this queue (``<instance>-<n>``, the instance random): a drafter that kept an
  ACK while the coordinator was down sends it to the restarted coordinator's new queue, where a
  bare counter would have matched, and removed, a new request that was given the same number.
* A delivered request stays with its consumer until ACKed; ``release(consumer)`` puts that
  consumer's unacknowledged requests back at the FRONT, in their original order (they were
  first in line, and a drafter crash must not push them behind later arrivals).
* Bounded: at most ``max_depth`` requests wait (not yet delivered); ``put`` on a full queue raises
  QueueFull at once instead of letting a backlog grow without limit. Delivered requests do not
  count (their consumers hold them), and ``release`` always puts them back, even past the bound:
  they were accepted once and must not be lost.
* ``ack`` is idempotent and consumer-agnostic, like XACK + XDEL: "this request is finished"
  removes it wherever it is - held by another consumer after a re-delivery, or back in line
  after a release. A late ACK from a drafter whose link dropped therefore still prevents a
  duplicate generation.
* Each consumer may say how many sessions it can still take (``get``'s ``room``, or
  ``note_room``: the queue link notes a drafter's ``QueuePull.room`` and ``QueueRoom`` as they
  arrive); ``room()`` sums what is left of it, so the coordinator can tell when every drafter is
  full (``services/coordinator/queue_fallback.py``).
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict

from shared.log import get_logger
from shared.protocol import QueuedRequest
from shared.queue import Delivery, QueueError, QueueFull

log = get_logger("queue.memory")
#: the default bound on waiting requests (the coordinator passes its --max-queue)
DEFAULT_MAX_DEPTH = 1024


class MemoryQueue:
    """An asyncio FIFO with per-consumer acknowledgement tracking. Not thread-safe: one loop."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        """``max_depth``: most requests waiting at once; 0 means no bound."""
        if max_depth < 0:
            raise ValueError(f"max_depth must be >= 0 (0: no bound), got {max_depth}")
        self.max_depth = max_depth
        self._ready: OrderedDict[str, QueuedRequest] = OrderedDict()
        self._held: dict[str, dict[str, QueuedRequest]] = {}  # consumer -> {delivery_id: request}
        self._owner: dict[str, str] = {}  # delivery_id -> consumer holding it
        #: consumer -> the sessions it can still take (its last ``get``'s room less what it took
        #: since); None: its last ``get`` did not say
        self._room: dict[str, int | None] = {}
        self._instance = secrets.token_hex(4)
        self._next_id = 0
        self._changed = asyncio.Condition()
        self._closed = False

    async def put(self, request: QueuedRequest) -> None:
        """Append ``request``; QueueFull when ``max_depth`` requests already wait."""
        self._check_open()
        if self.max_depth and len(self._ready) >= self.max_depth:
            raise QueueFull(
                f"the in-process request queue is full: {self.max_depth} requests already wait for a drafter"
            )
        self._next_id += 1
        self._ready[f"{self._instance}-{self._next_id}"] = request
        await self._notify()

    async def get(self, consumer: str, max_items: int = 1, timeout_s: float | None = None,
                  room: int = 0) -> list[Delivery]:
        """Wait up to ``timeout_s`` for at least one request; [] on timeout. ``room``: the
        sessions ``consumer`` can still take, this call's included (0: not said).

        Cancellation-safe: requests are taken only after the wait has finished, with no
        suspension point in between, so a cancelled ``get`` never swallows a request.
        """
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        if room > 0 or consumer not in self._room:  # 0 says nothing new
            self.note_room(consumer, room or None)
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                await self._changed.wait_for(lambda: bool(self._ready) or self._closed)
                self._check_open()
                return self._take(consumer, max_items)
        except TimeoutError:
            return []

    async def ack(self, consumer: str, delivery_id: str) -> None:
        """Remove the request for good, wherever it is; unknown ids are ignored."""
        if self._ready.pop(delivery_id, None) is not None:
            return
        owner = self._owner.pop(delivery_id, None)
        if owner is None:
            return  # already acknowledged (or never existed): ACK is idempotent
        held = self._held[owner]
        del held[delivery_id]
        if not held:
            del self._held[owner]
        if owner != consumer:
            log.info(
                "request acknowledged by another consumer", delivery_id=delivery_id, holder=owner, acked_by=consumer
            )

    async def release(self, consumer: str) -> None:
        """Put the consumer's unacknowledged requests back at the front, oldest first."""
        self._room.pop(consumer, None)
        held = self._held.pop(consumer, None)
        if not held:
            return
        for delivery_id in sorted(held, key=_number, reverse=True):
            del self._owner[delivery_id]
            self._ready[delivery_id] = held[delivery_id]
            self._ready.move_to_end(delivery_id, last=False)
        log.info("released unacknowledged requests", consumer=consumer, count=len(held))
        await self._notify()

    async def depth(self) -> int:
        return len(self._ready)

    def note_room(self, consumer: str, room: int | None) -> None:
        """``consumer`` can take ``room`` more sessions (None: it does not say)."""
        self._room[consumer] = room

    def room(self) -> int | None:
        """The sessions the consumers can still take, summed (0: every one is full); None while
        no consumer has pulled yet or one did not say."""
        left = list(self._room.values())
        if not left or any(r is None for r in left):
            return None
        return sum(r for r in left if r is not None)

    def waiting_ids(self) -> list[str]:
        """The request ids not yet delivered, in the order consumers will get them."""
        return [request.request_id for request in self._ready.values()]

    def in_flight(self) -> int:
        """Requests delivered but not yet acknowledged (for metrics)."""
        return len(self._owner)

    async def close(self) -> None:
        """Wake every waiting ``get`` with QueueError; later calls to put/get fail the same way."""
        self._closed = True
        await self._notify()

    def _take(self, consumer: str, max_items: int) -> list[Delivery]:
        out: list[Delivery] = []
        held = self._held.setdefault(consumer, {})
        while self._ready and len(out) < max_items:
            delivery_id, request = self._ready.popitem(last=False)
            held[delivery_id] = request
            self._owner[delivery_id] = consumer
            out.append(Delivery(delivery_id, request))
        left = self._room.get(consumer)
        if left is not None:
            self._room[consumer] = max(0, left - len(out))
        return out

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise QueueError("the in-process request queue is closed (the coordinator is shutting down)")


def _number(delivery_id: str) -> int:
    """A delivery's place in the queue's order (ids are ``<instance>-<n>``)."""
    return int(delivery_id.rpartition("-")[2])
