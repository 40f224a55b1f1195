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
  arrive); ``room()`` sums what is left of it (less what each took since, plus what finished
  since: ``note_finished`` or the ACK), so the coordinator can tell when every drafter is full
  (``services/coordinator/queue_fallback.py``).
* Whose turn: when several consumers wait, a request goes to the one that drafts on the least
  loaded machine (its ``site``: the consumers of a site share its cores) and, within a site, to the
  one that already holds the most (``_turn``). Drafters on separate machines so share the load;
  drafters on one machine fill one batch before the next, since each batch reads its own copy of
  the draft's weights a forward from the same cores (bench/results/edge-drafts.md: two drafters
  of 2 sessions on one core ran at 0.90x target-only, one of 4 at 1.21x). A consumer that took a
  request, or whose request finished (``note_finished``, or its ACK), less than ``TURN_GRACE_S``
  ago and has room keeps its turn while its next pull is on the way; past that, any waiting
  consumer takes the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import Counter, OrderedDict

from shared.log import get_logger
from shared.protocol import QueuedRequest
from shared.queue import Delivery, QueueError, QueueFull

log = get_logger("queue.memory")
#: the default bound on waiting requests (the coordinator passes its --max-queue)
DEFAULT_MAX_DEPTH = 1024
#: how long a consumer that just took or finished a request (and has room) keeps its turn for its
#: next pull (a drafter starts the session it took, on a busy core, before it pulls again)
TURN_GRACE_S = 0.1


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
        #: since, plus those of its requests that finished since); None: its last ``get`` did not say
        self._room: dict[str, int | None] = {}
        self._most: dict[str, int] = {}  # consumer -> the most room it ever said (what it may free up to)
        self._site: dict[str, str] = {}  # consumer -> the machine it drafts on (absent: its own)
        self._waiting: dict[str, int] = {}  # consumer -> its gets waiting now, in the order they came
        self._active_at: dict[str, float] = {}  # consumer -> when it last took or finished one (monotonic)
        self._finishing: set[str] = set()  # held deliveries whose last token went out (note_finished)
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
                self._waiting[consumer] = self._waiting.get(consumer, 0) + 1
                try:
                    await self._await_turn(consumer)
                    return self._take(consumer, max_items)
                finally:
                    self._leave(consumer)
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
        if delivery_id in self._finishing:
            self._finishing.discard(delivery_id)
        else:
            self._free_one(owner)
        if owner != consumer:
            log.info(
                "request acknowledged by another consumer", delivery_id=delivery_id, holder=owner, acked_by=consumer
            )
        await self._notify()  # who holds the most changed: whose turn it is may have too

    async def release(self, consumer: str) -> None:
        """Put the consumer's unacknowledged requests back at the front, oldest first."""
        self._room.pop(consumer, None)
        self._site.pop(consumer, None)
        self._active_at.pop(consumer, None)
        self._most.pop(consumer, None)
        held = self._held.pop(consumer, None)
        if not held:
            await self._notify()  # it may have been the one whose turn the others waited out
            return
        for delivery_id in sorted(held, key=_number, reverse=True):
            del self._owner[delivery_id]
            self._finishing.discard(delivery_id)
            self._ready[delivery_id] = held[delivery_id]
            self._ready.move_to_end(delivery_id, last=False)
        log.info("released unacknowledged requests", consumer=consumer, count=len(held))
        await self._notify()

    async def depth(self) -> int:
        return len(self._ready)

    def note_room(self, consumer: str, room: int | None) -> None:
        """``consumer`` can take ``room`` more sessions (None: it does not say)."""
        self._room[consumer] = room
        if room is not None:
            self._most[consumer] = max(room, self._most.get(consumer, 0))

    def note_site(self, consumer: str, site: str) -> None:
        """``consumer`` drafts on machine ``site`` ("": a machine of its own), with the others there."""
        if site:
            self._site[consumer] = site
        else:
            self._site.pop(consumer, None)

    def note_finished(self, request_id: str) -> None:
        """The coordinator relayed ``request_id``'s last token: its drafter ends the session and ACKs
        it in a moment, so the room it frees, and its turn, count from now (a client's next request
        may well arrive before that ACK)."""
        for consumer, held in self._held.items():
            for delivery_id, request in held.items():
                if request.request_id == request_id and delivery_id not in self._finishing:
                    self._finishing.add(delivery_id)
                    self._free_one(consumer)
                    return

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

    async def _await_turn(self, consumer: str) -> None:
        """Return (the condition's lock held) once a request waits and it is ``consumer``'s turn."""
        while True:
            self._check_open()
            if self._ready:
                whose, until = self._turn()
                if whose == consumer:
                    return
                # another's turn: look again when something changes, or when its turn lapses (at
                # the latest after TURN_GRACE_S: a change that notified nobody cannot strand a request)
                wait_s = TURN_GRACE_S if until is None else min(TURN_GRACE_S, until - time.monotonic())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, wait_s)):
                        await self._changed.wait()
            else:
                await self._changed.wait()

    def _turn(self) -> tuple[str | None, float | None]:
        """Whose turn the next request is: the consumer on the least loaded site and, within a site,
        the one holding the most; a waiting one before one still on its way back. With the time
        that consumer's turn lapses (None: it is waiting, so it does not)."""
        now = time.monotonic()
        coming = [c for c, at in self._active_at.items()
                  if c not in self._waiting and now - at < TURN_GRACE_S and (self._room.get(c) or 0) > 0]
        candidates = [*self._waiting, *coming]  # waiting ones first, in the order they came
        if not candidates:
            return None, None
        serving = {c: sum(d not in self._finishing for d in held) for c, held in self._held.items()}
        load: Counter[str] = Counter()
        for c, n in serving.items():
            load[self._site.get(c, c)] += n

        def key(c: str) -> tuple[int, int]:
            return load[self._site.get(c, c)], -serving.get(c, 0)

        whose = min(candidates, key=key)  # min is stable: ties go to the first candidate
        return whose, (None if whose in self._waiting else self._active_at[whose] + TURN_GRACE_S)

    def _free_one(self, consumer: str) -> None:
        """One of ``consumer``'s sessions ended: one more room, until its next pull says."""
        left = self._room.get(consumer)
        if left is not None:  # never past the most it said (a slot its pull already counted)
            self._room[consumer] = min(left + 1, self._most.get(consumer, left + 1))
            self._active_at[consumer] = time.monotonic()

    def _leave(self, consumer: str) -> None:
        left = self._waiting.pop(consumer) - 1
        if left:
            self._waiting[consumer] = left
        self._changed.notify_all()  # the turn may have passed to another waiting consumer

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
        self._active_at[consumer] = time.monotonic()
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
