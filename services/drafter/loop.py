"""The drafter's work-conserving serving loop (StarSD §3): many sessions on one draft model.

Per verifier connection:

* admission takes requests from the queue whenever a slot is free, so the draft model never
  idles while work waits, and never serves more sessions than its admission control allows
  (``control/admission.py``: ``max_sessions``, or with ``--admission starsd`` StarSD's N_max);
* each admitted request runs as its own task (``rounds.SessionRunner``); their draft jobs go to
  one ``DraftBatcher``, which drafts every ready session together on the compute worker, and
  their frames share one WebSocket;
* a finished session acks its queue delivery and frees its slot at once.

When the link drops, sessions are dropped WITHOUT acking (the verifier finishes them
target-only), the queue is told to ``release`` this consumer's deliveries (after
``HAND_BACK_DELAY_S``, so that coordinators re-open them first on another verifier replica), and
the loop reconnects; re-opened requests the verifier still knows come back "duplicate" and are acked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.drafter.batcher import DraftBatcher
from services.drafter.control.admission import make_admission
from services.drafter.control.base import DraftController
from services.drafter.link import VerifierLink
from services.drafter.metrics import DrafterMetrics
from services.drafter.proposers.base import Proposer
from services.drafter.rounds import RoundSettings, SessionAborted, SessionRunner
from services.drafter.sessions import DraftSession
from services.drafter.worker import ComputeWorker
from shared.log import get_logger
from shared.queue import Delivery, QueueError, RequestQueue

log = get_logger("drafter.loop")

#: How long one queue poll waits before admission re-checks its state.
QUEUE_POLL_S = 1.0
#: Upper bound on queue calls made while shutting down, so a dead queue cannot hang the exit.
SHUTDOWN_QUEUE_TIMEOUT_S = 5.0
#: After losing its verifier, wait this long before handing our deliveries back to the queue. With
#: verifier replicas, a drafter on another replica would otherwise take them and open them there
#: afresh before the coordinators have noticed the loss and re-opened them there from what they
#: relayed (then the coordinator's re-open is refused as a duplicate and the request fails).
HAND_BACK_DELAY_S = 1.0


@dataclass
class LoopStats:
    connections: int = 0
    sessions_finished: int = 0
    sessions_aborted: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class LoopSettings:
    """Who the drafter is and how it takes requests (the drafter's flags of these names)."""

    node_id: str
    max_sessions: int
    reconnect_s: float = 1.0
    admission: str = "max-sessions"  # or starsd: StarSD's N_max (control/admission.py)
    rounds: RoundSettings = field(default_factory=RoundSettings)  # the Welcome sets its limits per connection


class DrafterLoop:
    def __init__(self, settings: LoopSettings, *, link: VerifierLink, queue: RequestQueue, proposer: Proposer,
                 worker: ComputeWorker, new_controller: Callable[[], DraftController],
                 on_session_end: Callable[[DraftSession], None] | None = None,
                 metrics: DrafterMetrics | None = None) -> None:
        self.settings = settings
        self.admission = make_admission(settings.admission)  # how many sessions to claim
        self.node_id = settings.node_id
        self.max_sessions = settings.max_sessions
        self.link = link
        self.queue = queue
        self.proposer = proposer
        self.worker = worker
        self.new_controller = new_controller
        self.reconnect_s = settings.reconnect_s
        self.on_session_end = on_session_end
        self.metrics = metrics or DrafterMetrics()
        self.stats = LoopStats()
        self._sessions: dict[str, DraftSession] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._slot_freed = asyncio.Event()

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    async def run(self, ready: asyncio.Event | None = None) -> None:
        """Serve until cancelled. Raises LinkRefused when the verifier refuses us for good."""
        try:
            while True:
                welcome = await self.link.connect_with_retry(self.reconnect_s)
                self.stats.connections += 1
                if ready is not None:
                    ready.set()
                batcher = DraftBatcher(self.proposer, self.worker, self.metrics, self.max_sessions)
                rounds = self.settings.rounds
                allowed = replace(rounds, max_draft_tokens=welcome.max_draft_tokens,
                                  conditional=rounds.conditional and welcome.conditional_drafts)
                runner = SessionRunner(self.link, self.proposer, self.worker, batcher, allowed, self.metrics,
                                       lambda: len(self._sessions))
                await self._serve_connection(runner, batcher)
                log.warning("lost the verifier; sessions left to the verifier, reconnecting",
                            retry_in_s=self.reconnect_s, hand_back_in_s=HAND_BACK_DELAY_S)
                await asyncio.sleep(HAND_BACK_DELAY_S)
                await self._release()
                await asyncio.sleep(max(0.0, self.reconnect_s - HAND_BACK_DELAY_S))
        finally:
            await self._drop_sessions()
            await self.link.close()
            await self._release()

    async def _serve_connection(self, runner: SessionRunner, batcher: DraftBatcher) -> None:
        """Admit and serve sessions until the link drops."""
        receiver = asyncio.create_task(self.link.receive_loop(), name="verifier-receive")
        admission = asyncio.create_task(self._admit(runner), name="admission")
        drafting = asyncio.create_task(batcher.run(), name="draft-batcher")
        try:
            done, _ = await asyncio.wait({receiver, admission, drafting}, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {receiver}:
                task.result()  # admission and drafting only end by raising: surface the bug
        finally:
            for task in (admission, drafting, receiver):
                task.cancel()
            await asyncio.gather(admission, drafting, receiver, return_exceptions=True)
            await self._drop_sessions()
            await self.link.close()

    # --- admission -------------------------------------------------------------------------

    async def _admit(self, runner: SessionRunner) -> None:
        while True:
            self._slot_freed.clear()
            free = self.admission.limit(self.max_sessions, runner.batcher.capacity) - len(self._sessions)
            if free <= 0:
                await self._slot_freed.wait()
                continue
            try:
                # One at a time: the coordinator's queue then picks which drafter takes each request
                # (the one on the least loaded machine, and there the one serving the most), and
                # drafters reading Redis take turns, instead of the first one swallowing the backlog.
                # ``room`` tells an in-process queue how many more we take: once every drafter's
                # is taken, its coordinator starts further requests target-only at once
                deliveries = await self.queue.get(self.node_id, max_items=1, timeout_s=QUEUE_POLL_S, room=free)
            except QueueError as exc:
                log.warning("queue unavailable; retrying", error=str(exc), retry_in_s=self.reconnect_s)
                await asyncio.sleep(self.reconnect_s)
                continue
            for delivery in deliveries:
                self._start(runner, delivery)

    def _start(self, runner: SessionRunner, delivery: Delivery) -> None:
        rid = delivery.request.request_id
        current = self._sessions.get(rid)
        if current is not None:  # at-least-once delivery handed us a request we are serving
            current.extra_deliveries.append(delivery.delivery_id)
            return
        session = DraftSession.from_delivery(delivery, self.new_controller())
        self._sessions[rid] = session
        self.metrics.sessions.set(len(self._sessions))
        self._tasks[rid] = asyncio.create_task(self._serve(runner, session), name=f"session-{rid}")
        log.debug("session admitted", request_id=rid, active=len(self._sessions))

    async def _serve(self, runner: SessionRunner, session: DraftSession) -> None:
        rid = session.request_id
        try:
            if await runner.run(session):
                self._record(session)
                await self._ack(session)
        except (SessionAborted, asyncio.CancelledError) as exc:
            self.stats.sessions_aborted += 1
            log.info("session dropped with the verifier link; not acked", request_id=rid)
            if isinstance(exc, asyncio.CancelledError):
                raise
        except Exception:
            self.stats.sessions_aborted += 1
            log.exception("session failed; leaving it unacknowledged for re-delivery", request_id=rid)
        finally:
            self._sessions.pop(rid, None)
            self._tasks.pop(rid, None)
            self.metrics.sessions.set(len(self._sessions))
            self._slot_freed.set()
            if self.on_session_end is not None:
                self.on_session_end(session)

    def _record(self, session: DraftSession) -> None:
        self.stats.sessions_finished += 1
        self.stats.rounds += session.stats.rounds
        self.stats.drafted += session.stats.drafted
        self.stats.accepted += session.stats.accepted
        log.info("session finished", **session.summary())

    async def _ack(self, session: DraftSession) -> None:
        for delivery_id in [session.delivery.delivery_id, *session.extra_deliveries]:
            try:
                await self.queue.ack(self.node_id, delivery_id)
            except QueueError as exc:  # re-delivered later; the verifier then answers "duplicate"
                log.warning("could not ack a finished request", request_id=session.request_id,
                            delivery_id=delivery_id, error=str(exc))

    # --- link loss -------------------------------------------------------------------------

    async def _drop_sessions(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _release(self) -> None:
        """Make our unacknowledged deliveries available again (the in-process queue needs this)."""
        try:
            async with asyncio.timeout(SHUTDOWN_QUEUE_TIMEOUT_S):
                await self.queue.release(self.node_id)
        except (QueueError, TimeoutError) as exc:  # Redis re-delivers after claim_idle_ms anyway
            log.warning("could not release our unacknowledged requests", error=str(exc) or "timed out")
