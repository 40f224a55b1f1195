"""One request's life inside the coordinator: queue it, then follow its TokenEvents to the end.

``Generator.submit`` subscribes to the request's events *before* queueing it (so no event can
slip past), and ``Submission.close`` always unsubscribes, releases the request's admission slot
and, unless the verifier reported the request finished, tells the verifier: Release when its
client may resume it (a recorded stream, ``resumption.py``: the verifier keeps it for the grace),
else Cancel, so the verifier frees its cache. ``close`` never awaits: it must also work from
cleanup code running in a task that was just cancelled by a client disconnect.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from services.coordinator.admission import InFlightLimit, Slot
from services.coordinator.errors import (
    ApiError,
    internal_error,
    invalid_request,
    request_timeout,
    service_unavailable,
    too_many_requests,
    verifier_busy,
)
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.openai_api import GenerationRequest
from services.coordinator.routing import Inbound
from services.coordinator.share import EvenShare
from services.coordinator.verifier_link import FrontendLink
from services.coordinator.verifier_pool import VerifierPool
from shared.log import get_logger
from shared.protocol import OpenSession, QueuedRequest, TokenEvent, TokenLogprob
from shared.queue import QueueError, QueueFull, RequestQueue

log = get_logger("coordinator.generation")
PUT_TIMEOUT_S = 10.0  # a queue that cannot take a request this fast is down, as far as clients care


def new_request_id() -> str:
    """128 random bits: a stream's id is all it takes to resume it (with its API key)."""
    return secrets.token_hex(16)


class ClientGone(Exception):
    """The client disconnected; the request was cancelled and nobody is left to answer."""

    status = 499  # nginx's "client closed request", for metrics only


class Submission:
    """A queued request whose events the caller reads with :meth:`events`.

    It owns the request's admission ``slot`` (see admission.py): :meth:`close` releases it.
    """

    def __init__(
        self, request_id: str, prompt_tokens: int, events: asyncio.Queue[Inbound], link: FrontendLink | VerifierPool,
        metrics: CoordinatorMetrics, timeout_s: float, *, slot: Slot | None = None, retry_after_s: int = 1,
        opened: OpenSession | None = None,
    ) -> None:
        self.request_id = request_id
        #: how the request was opened, in its target-only form (what a resume or a verifier restart re-opens)
        self.opened = opened
        self.prompt_tokens = prompt_tokens
        self._generated = 0
        self.final: TokenEvent | None = None
        #: ``time.perf_counter()`` when the event :meth:`events` yielded last came in from the verifier
        self.arrived = 0.0
        self._events = events
        self._peeked: Inbound | None = None
        self._link = link
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._slot = slot
        self._retry_after_s = retry_after_s
        self._queued_at = time.monotonic()
        self._first_at = 0.0  # when the first token arrived (0: not yet)
        self._deadline = self._queued_at + timeout_s
        self._aborted = False
        self._verifier_done = False
        self._timed_out = False
        self._closed = False
        #: its client may resume it (its record is stored): a close before its end releases it in
        #: the verifier (kept for the grace, for another coordinator to adopt) instead of cancelling it
        self.resumable = False

    def abort(self, reason: str) -> None:
        """The client went away: end :meth:`events` (with ClientGone) as soon as possible."""
        self._aborted = True
        cancelled = TokenEvent(request_id=self.request_id, origin="", token_ids=[], text="", finished=True,
                               finish_reason="cancelled", error=reason)
        self._events.put_nowait(Inbound(cancelled, time.perf_counter()))

    async def started(self) -> None:
        """Wait for the request's first event without consuming it (:meth:`events` yields it).

        Raises as :meth:`events` does when that first event is already a failure (verifier busy:
        503 with Retry-After; refused as invalid: 400; error: 500; link lost: 503), on timeout and
        after :meth:`abort`, so a stream that waits for this before sending its headers still
        answers with the real status.
        """
        if self._peeked is None:
            self._peeked = await self._next()
        if self._peeked.event.finished:
            self._check(self._peeked)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Yield the request's TokenEvents up to and including the final one.

        Raises ApiError 504 on timeout, 503 if the verifier was busy (with Retry-After) or cancelled
        it (e.g. the link dropped), 400 if it refused the request as invalid (a field its backend
        does not serve, a request larger than its KV cache), 500 if it failed, and ClientGone after
        :meth:`abort`.
        """
        first = True
        while True:
            item = await self._next()
            event = item.event
            self.arrived = item.arrived
            if first and (event.token_ids or event.text):
                self._first_at = time.monotonic()
                self._metrics.first_token(self._first_at - self._queued_at)
                first = False
            if event.finished:
                event = self._finish(item)
            else:
                self._generated += len(event.token_ids)
            yield event
            if event.finished:
                return

    async def _next(self) -> Inbound:
        """The next event (the one :meth:`started` peeked at first), within the request's deadline."""
        if self._peeked is not None:
            item, self._peeked = self._peeked, None
        else:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that meets an event
                async with asyncio.timeout(max(self._deadline - time.monotonic(), 0.0)):
                    item = await self._events.get()
            except TimeoutError:
                self._timed_out = True
                log.warning("request timed out", request_id=self.request_id, timeout_s=self._timeout_s)
                raise request_timeout(self._timeout_s) from None
        if self._aborted:
            raise ClientGone(self.request_id)
        return item

    def _check(self, item: Inbound) -> None:
        """The verifier is done with the request: raise the ApiError a failed final event stands for."""
        self._verifier_done = True
        event = item.event
        if item.code == "busy":
            log.info("verifier busy; request refused", request_id=self.request_id, reason=event.error)
            raise verifier_busy(event.error, self._retry_after_s)
        if event.error_code == "moved":
            raise ApiError(409, f"{event.error}: this connection no longer relays it", "invalid_request_error", None,
                           "stream_moved")
        if "invalid" in (item.code, event.error_code):
            raise invalid_request(f"the verifier cannot serve this request as asked: {event.error}")
        if event.finish_reason == "cancelled":
            raise service_unavailable(f"the request was cancelled: {event.error or 'by the verifier'}. Retry it.")
        if event.error or event.finish_reason == "error":
            raise internal_error(f"generation failed in the verifier: {event.error or 'unknown error'}")

    def _finish(self, item: Inbound) -> TokenEvent:
        """Check the final event; fill usage counts the verifier left at 0 from what we saw."""
        self._check(item)
        event = item.event
        self._generated += len(event.token_ids)
        if not event.prompt_tokens or not event.completion_tokens:
            event = msgspec.structs.replace(event, prompt_tokens=event.prompt_tokens or self.prompt_tokens,
                                            completion_tokens=event.completion_tokens or self._generated)
        self.final = event
        self._metrics.finished(event)
        if self._first_at and self._generated > 1:
            self._metrics.per_token((time.monotonic() - self._first_at) / (self._generated - 1))
        return event

    def close(self) -> None:
        """Release the subscription and the admission slot; unless the request finished (or was
        refused) in the verifier, or another connection took it over, release it there (resumable)
        or cancel it. Idempotent; never awaits."""
        if self._closed:
            return
        self._closed = True
        ours = self._link.routing.subs.get(self.request_id) is self._events  # else another stream adopted it
        self._link.unsubscribe(self.request_id, self._events)
        if self._slot is not None:
            self._slot.release()
        if self._verifier_done or not ours:
            return
        if self.resumable and not self._timed_out and self._link.grace_s > 0:
            self._link.release_nowait(self.request_id)
            log.info("request released for a resume", request_id=self.request_id, grace_s=self._link.grace_s)
        else:
            self._link.cancel_nowait(self.request_id)
            log.info("request cancelled", request_id=self.request_id, client_gone=self._aborted)


#: on: always through drafters; off: always target-only; auto: drafters when any is connected and
#: the verifier's policy wants drafts
SPECULATION_MODES = ("on", "off", "auto")


class Generator:
    """Turns validated requests into queued work and Submissions; ``admission`` caps how many
    requests are inside at once."""

    def __init__(self, queue: RequestQueue, link: FrontendLink | VerifierPool, node_id: str, timeout_s: float,
                 metrics: CoordinatorMetrics, speculation: str = "auto",
                 admission: InFlightLimit | None = None) -> None:
        if speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {speculation!r}")
        self.speculation = speculation
        self.admission = admission if admission is not None else InFlightLimit(0, 1, metrics.in_flight)
        self._queue = queue
        self._link = link
        self._node_id = node_id
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._drafted = EvenShare()  # of new requests, the share the verifier wants drafted for

    async def submit(self, req: GenerationRequest, slot: Slot | None = None, request_id: str = "",
                     send: bool = True) -> Submission:
        """Queue ``req`` (as ``request_id``, else a new id): 503 when no verifier is connected to serve
        it (Retry-After: it is reconnecting) or the queue is down, 429 (Retry-After) when the queue is
        full. Takes over ``slot``: the Submission's close releases it, and so does a failure here.
        ``send=False`` only subscribes: :meth:`send` sends it later (after its stream is recorded)."""
        if not self._link.connected:
            if slot is not None:
                slot.release()
            raise service_unavailable(
                f"the verifier is not connected ({self._link.last_error or 'connecting'}); retry shortly",
                self.admission.retry_after_s)
        rid = request_id or new_request_id()
        opened = OpenSession(request_id=rid, prompt_ids=req.prompt_ids, params=req.params, origin=self._node_id,
                             speculative=False, slo_tokens_per_s=req.slo_tokens_per_s)
        sub = self._subscribed(opened, slot)
        if send:
            await self.send(req, sub)
        return sub

    async def send(self, req: GenerationRequest, sub: Submission) -> None:
        """Send ``sub`` (a Submission of ``req`` subscribed by :meth:`submit`) to a drafter through
        the queue, or target-only to the verifier; on a failure it is closed (releasing its slot)."""
        try:
            if sub.opened is None:
                raise ValueError(f"submission {sub.request_id} was not made by submit(): nothing to send")
            speculative = self.to_drafter()
            if speculative:
                await self._enqueue(req, sub.request_id)
            else:
                self._open_target_only(sub.opened)
            self._metrics.routed.labels("drafter" if speculative else "target_only").inc()
        except BaseException:
            sub.close()
            raise

    def follow(self, opened: OpenSession, slot: Slot | None) -> Submission:
        """A Submission for a request opened before (here or by another coordinator), to adopt it.
        A stream of this coordinator still relaying it ends: its client is told the stream moved."""
        rid = opened.request_id
        old = self._link.routing.forget(rid)
        if old is not None:
            old.put_nowait(Inbound(TokenEvent(
                request_id=rid, origin=self._node_id, token_ids=[], text="", finished=True, finish_reason="cancelled",
                error="the stream was resumed on another connection", error_code="moved"), time.perf_counter()))
        return self._subscribed(msgspec.structs.replace(opened, origin=self._node_id), slot)

    def _subscribed(self, opened: OpenSession, slot: Slot | None) -> Submission:
        """A Submission of ``opened`` (subscribed before it is queued or adopted, so no event slips past)."""
        rid = opened.request_id
        return Submission(rid, len(opened.prompt_ids), self._link.subscribe(rid, opened), self._link, self._metrics,
                          self._timeout_s, slot=slot, retry_after_s=self.admission.retry_after_s, opened=opened)

    def _open_target_only(self, opened: OpenSession) -> None:
        try:
            self._link.open_target_only(opened)
        except ConnectionError as exc:
            raise service_unavailable(f"cannot reach the verifier: {exc}") from None
        log.debug("request sent target-only", request_id=opened.request_id, prompt_tokens=len(opened.prompt_ids))

    async def _enqueue(self, req: GenerationRequest, rid: str) -> None:
        queued = QueuedRequest(request_id=rid, prompt_ids=req.prompt_ids, params=req.params,
                               origin=self._node_id, model=req.model, created_at=time.time(),
                               slo_tokens_per_s=req.slo_tokens_per_s)
        retry_after = self.admission.retry_after_s
        try:
            async with asyncio.timeout(PUT_TIMEOUT_S):  # not wait_for: see Submission._next
                await self._queue.put(queued)
        except QueueFull as exc:
            raise too_many_requests(f"Cannot queue the request: {exc}. Retry after {retry_after} s; "
                                    "more drafters drain the queue faster.", retry_after) from None
        except (QueueError, OSError, TimeoutError) as exc:
            reason = str(exc) or f"the queue did not accept it within {PUT_TIMEOUT_S:g} s"
            raise service_unavailable(f"cannot queue the request: {reason}") from None
        log.debug("request queued", request_id=rid, prompt_tokens=len(req.prompt_ids), kind=req.kind)

    def to_drafter(self) -> bool:
        """Whether the next request goes to a drafter (via the queue) or target-only to the verifier.
        With ``auto``: while a drafter is connected, the share of requests the verifier's
        draft-length policy wants drafted for (all, unless SmartSpec finds plain decoding the better
        goodput; a share below 1 is spread evenly: every 1/share-th request)."""
        if self.speculation != "auto":
            return self.speculation == "on"
        return bool(self._link.drafters) and self._drafted.take(self._link.draft_share)


@dataclass
class Collected:
    """A whole generation: its text, final event, token ids and (if asked for) their logprobs."""

    text: str
    final: TokenEvent
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None


async def collect(sub: Submission) -> Collected:
    """Run a submission to its end."""
    parts: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    async for event in sub.events():
        parts.append(event.text)
        ids.extend(event.token_ids)
        logprobs.extend(event.logprobs or [])
    assert sub.final is not None  # events() returns normally only after a successful final event
    return Collected("".join(parts), sub.final, ids, logprobs if len(logprobs) == len(ids) else None)


__all__ = ["ApiError", "ClientGone", "Collected", "Generator", "Submission", "collect"]
