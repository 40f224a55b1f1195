"""The coordinator's persistent WebSocket link to the verifier (role "frontend").

The verifier streams every committed token of the requests this coordinator queued back over
this one link (TokenEvent, routed here by the request's ``origin``), plus periodic FleetStatus
frames saying which drafters are up. The link routes each TokenEvent (also inside a Batch) to
the per-request asyncio.Queue its handler subscribed, as an :class:`Inbound` stamped with the
time its frame arrived (for the relay-time metric), turns an ErrorFrame about a request into a
final Inbound carrying the verifier's error code (``busy`` becomes a 503), sends Cancel when a
client goes away, and reconnects with exponential backoff.

Events sent while the link is down are lost. In-flight requests wait for the link to come back
(up to ``RESUME_WAIT_S``): when it comes back to a *new* verifier instance (``Welcome.instance``
differs: the verifier restarted), each is re-opened there from what this coordinator relayed
(``resume.py``), before anything else is sent, and their streams go on; when it comes back to
the same instance, or never, they fail with a clear "cancelled" event (a 503) rather than hang
or return text with holes in it. Either way ``ResumeDone`` follows, which tells the verifier
that drafters may open this coordinator's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import websockets
from websockets.asyncio.client import ClientConnection, connect

from services.coordinator.resume import RESUME_WAIT_S
from services.coordinator.routing import Inbound, Routing
from shared.log import get_logger
from shared.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Adopt,
    Adopted,
    Cancel,
    ErrorFrame,
    FinishReason,
    FleetStatus,
    Hello,
    Message,
    OpenSession,
    ProtocolError,
    Refused,
    Release,
    ResumeDone,
    TokenEvent,
    Welcome,
    decode,
    encode,
    unpack,
)
from shared.tls import ssl_kwargs

log = get_logger("coordinator.verifier_link")


class FrontendRefused(RuntimeError):
    """The verifier answered the handshake, but not with a usable Welcome."""

__all__ = ["Backoff", "FrontendLink", "FrontendRefused", "Inbound", "Replica"]


@dataclass(frozen=True)
class Backoff:
    """How the link waits: between reconnects (doubling from ``min_s`` to ``max_s``) and for a handshake."""

    min_s: float = 0.1
    max_s: float = 5.0
    handshake_timeout_s: float = 10.0


@dataclass(frozen=True)
class Replica:
    """The link as one of several replicas' (``VerifierPool``): the requests shared with the other
    links, this replica's index, and what to call when this link goes down (the pool moves its
    requests to another replica)."""

    routing: Routing
    index: int = 0
    on_lost: Callable[[int], None] | None = None


class FrontendLink:
    """A self-healing client of the verifier's ``/v1/frontend`` endpoint."""

    def __init__(self, url: str, node_id: str, auth_token: str = "", tokenizer_fingerprint: str = "", *,
                 backoff: Backoff = Backoff(), tls: ssl.SSLContext | None = None,
                 replica: Replica | None = None) -> None:
        self._tls = tls  # wss://: the CA-pinned client context (shared.tls.client_context)
        self.url = url
        self.node_id = node_id
        self._auth_token = auth_token
        self._fingerprint = tokenizer_fingerprint
        self._min_backoff = backoff.min_s
        self._max_backoff = backoff.max_s
        self._handshake_timeout = backoff.handshake_timeout_s
        self.welcome: Welcome | None = None
        self.drafters: list[str] = []
        self.draft_share = 1.0  # of new requests, the verifier's policy wants drafted for (FleetStatus)
        self.sessions = 0
        self.last_error = "not connected yet"
        replica = replica or Replica(Routing())
        self._routing = replica.routing
        self.index = replica.index
        self._on_lost = replica.on_lost
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._up = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._instance: str | None = None  # the verifier instance of the last connection
        self._readopting: set[str] = set()  # requests adopted again after the link came back
        self._down_since: float | None = None

    # --- what request handlers use ------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._up.is_set()

    @property
    def routing(self) -> Routing:
        """The requests in flight (shared with the other replicas' links in a pool)."""
        return self._routing

    def subscribe(self, request_id: str, opened: OpenSession | None = None) -> asyncio.Queue[Inbound]:
        """The queue that will receive ``request_id``'s TokenEvents; subscribe before queueing.

        Unbounded on purpose, and still bounded in practice: the verifier sends one event per
        round that commits at least one token, plus one final event, so a request never has more
        than ``max_tokens + 1`` events (and only the ones its client has not read yet wait here;
        the number of requests is capped by --max-in-flight). A maxsize would make the one
        reader of this link block on a single slow client and stall every other request.
        ``opened``: the request in its target-only form, kept to re-open it on a restarted verifier.
        """
        return self._routing.subscribe(request_id, opened)

    def unsubscribe(self, request_id: str, queue: asyncio.Queue[Inbound] | None = None) -> None:
        """Stop relaying ``request_id`` here (only if ``queue``, when given, still subscribes it)."""
        self._routing.forget(request_id, queue)

    @property
    def welcomed(self) -> bool:
        """Whether the verifier has welcomed this coordinator (since it started): before that its grace is unknown."""
        return self.welcome is not None

    @property
    def grace_s(self) -> float:
        """How long the verifier keeps a released request for a resume (``Welcome.orphan_grace_s``)."""
        return self.welcome.orphan_grace_s if self.welcome is not None else 0.0

    def release_nowait(self, request_id: str) -> None:
        """The client left but may resume: the verifier keeps the request for the grace (never blocks)."""
        if self.connected:
            self._outbox.put_nowait(encode(Release(request_id=request_id)))

    def adopt_nowait(self, request_id: str) -> asyncio.Future[Adopted]:
        """Ask the verifier to relay ``request_id`` here; the future gets its Adopted answer (its
        replayed events go to the request's subscriber). Raises ConnectionError when the link is down."""
        if not self.connected:
            raise ConnectionError(f"the verifier link is down: {self.last_error}")
        future: asyncio.Future[Adopted] = asyncio.get_running_loop().create_future()
        previous = self._routing.adopting.pop((request_id, self.index), None)
        if previous is not None and not previous.done():
            previous.set_exception(ConnectionError("adopted again"))
        self._routing.adopting[(request_id, self.index)] = future
        self._outbox.put_nowait(encode(Adopt(request_id=request_id)))
        return future

    def cancel_nowait(self, request_id: str) -> None:
        """Ask the verifier to stop ``request_id``. Never blocks, so it is safe in cleanup code
        that runs inside an already-cancelled task; dropped when the link is down."""
        if self.connected:
            self._outbox.put_nowait(encode(Cancel(request_id=request_id)))
        else:
            log.debug("cancel dropped: verifier link is down", request_id=request_id)

    def open_target_only(self, session: OpenSession) -> None:
        """Ask the verifier to decode a session by itself (no drafter). Raises when the link is down."""
        if not self.connected:
            raise ConnectionError(f"the verifier link is down: {self.last_error}")
        self._routing.where[session.request_id] = self.index
        self._outbox.put_nowait(encode(session))

    def send(self, msg: OpenSession | Cancel) -> None:
        """Queue one frame for the verifier (dropped while the link is down)."""
        if self.connected:
            self._outbox.put_nowait(encode(msg))

    async def cancel(self, request_id: str) -> None:
        self.cancel_nowait(request_id)

    async def wait_connected(self, timeout_s: float) -> bool:
        """True once the link is up (Welcome received), False after ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._up.wait()
        except TimeoutError:
            return False
        return True

    @property
    def max_model_len(self) -> int:
        """The verifier's context limit (0 until a Welcome arrived)."""
        return self.welcome.max_model_len if self.welcome else 0

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="verifier-link")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._down("the coordinator is shutting down")
        self._fail_all("the coordinator is shutting down")

    async def _run(self) -> None:
        delay = self._min_backoff
        while True:
            try:
                await self._connect_once()
                delay = self._min_backoff
                reason = "the verifier closed the connection"
            except FrontendRefused as exc:
                reason = str(exc)
                delay = self._max_backoff  # a configuration problem: no point hammering
                log.error("verifier refused the link", url=self.url, reason=reason)
                self._fail_all(reason)
            except (OSError, TimeoutError, websockets.exceptions.WebSocketException, ProtocolError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                if self._up.is_set():  # it was up: a fresh outage, so retry soon (the verifier may restart)
                    delay = self._min_backoff
                log.warning("verifier link failed", url=self.url, reason=reason, retry_in_s=delay)
            self._down(reason)
            if self._down_since is not None and time.monotonic() - self._down_since > RESUME_WAIT_S:
                self._fail_all(f"{reason} (for over {RESUME_WAIT_S:g} s)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._max_backoff)

    async def _connect_once(self) -> None:
        headers = {"Authorization": f"Bearer {self._auth_token}"} if self._auth_token else None
        async with connect(
            self.url,
            additional_headers=headers,
            max_size=MAX_FRAME_BYTES,
            open_timeout=self._handshake_timeout,
            proxy=None,
            **ssl_kwargs(self._tls),
        ) as ws:
            try:
                self.welcome = await self._handshake(ws)
            except FrontendRefused as exc:
                await ws.close(1008, "refused")  # a clean close, not the 1011 of an exception exit
                raise exc
            self._outbox = asyncio.Queue()
            self._resume_or_fail(self.welcome)  # first in the new outbox: before any new request
            self._up.set()
            self.last_error = ""
            log.info("verifier link up", url=self.url, verifier=self.welcome.node_id,
                     target_model=self.welcome.target_model, max_model_len=self.welcome.max_model_len)
            writer = asyncio.create_task(self._write(ws), name="verifier-link-writer")
            try:
                async for raw in ws:
                    self._dispatch(raw)
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer

    async def _handshake(self, ws: ClientConnection) -> Welcome:
        hello = Hello(role="frontend", node_id=self.node_id, protocol_version=PROTOCOL_VERSION,
                      tokenizer_fingerprint=self._fingerprint)
        await ws.send(encode(hello))
        async with asyncio.timeout(self._handshake_timeout):
            reply = decode(await ws.recv())
        if isinstance(reply, Refused):
            raise FrontendRefused(f"the verifier refused this coordinator ({reply.code}): {reply.message}")
        if not isinstance(reply, Welcome):
            raise FrontendRefused(f"expected a Welcome from the verifier, got {type(reply).__name__}")
        if reply.protocol_version != PROTOCOL_VERSION:
            raise FrontendRefused(f"the verifier speaks protocol {reply.protocol_version}, we speak {PROTOCOL_VERSION}")
        if self._fingerprint and reply.tokenizer_fingerprint and reply.tokenizer_fingerprint != self._fingerprint:
            raise FrontendRefused(
                f"the verifier's tokenizer (fingerprint {reply.tokenizer_fingerprint}) differs from the one "
                f"the coordinator loaded from --model ({self._fingerprint}); point both at the same target model"
            )
        return reply

    async def _write(self, ws: ClientConnection) -> None:
        while True:
            frame = await self._outbox.get()
            await ws.send(frame)

    def _dispatch(self, raw: bytes | str) -> None:
        arrived = time.perf_counter()  # before decoding: the relay time includes it
        try:
            msgs = unpack(decode(raw))
        except ProtocolError as exc:
            log.warning("bad frame from the verifier", error=str(exc))
            return
        for msg in msgs:
            self._dispatch_one(msg, arrived)

    def _dispatch_one(self, msg: Message, arrived: float) -> None:
        if isinstance(msg, TokenEvent):
            queue = self._routing.subs.get(msg.request_id)
            if queue is None:
                log.debug("token event for an unknown request dropped", request_id=msg.request_id)
            elif self._routing.ledger.seen(msg) or (msg.request_id, self.index) in self._routing.adopting:
                return  # relayed before (a re-adopt's replay), or sent before our Adopt: its replay has it
            elif not self._routing.claim(msg.request_id, self.index):  # another replica serves it
                log.info("events from a second replica for a request; cancelled there", request_id=msg.request_id,
                         verifier=self.url)
                if not msg.finished:
                    self._outbox.put_nowait(encode(Cancel(request_id=msg.request_id)))
            else:
                queue.put_nowait(Inbound(msg, arrived))
                self._routing.relayed(msg)
        elif isinstance(msg, FleetStatus):
            self.drafters = list(msg.drafters)
            self.draft_share = msg.draft_share
            self.sessions = msg.sessions
        elif isinstance(msg, ErrorFrame):
            self._on_error_frame(msg, arrived)
        elif isinstance(msg, Adopted):
            self._on_adopted(msg)
        else:
            log.warning("unexpected frame from the verifier", type=type(msg).__name__)

    def _on_adopted(self, reply: Adopted) -> None:
        """The verifier's answer to our Adopt: the request's events (replayed first) come from here."""
        if reply.state in ("live", "finished"):
            self._routing.where[reply.request_id] = self.index
        future = self._routing.adopting.pop((reply.request_id, self.index), None)
        if future is not None and not future.done():
            future.set_result(reply)
        elif reply.request_id in self._readopting:  # one of ours, after the link came back
            self._readopting.discard(reply.request_id)
            if reply.state == "gone":
                self._fail(reply.request_id, "lost the link to the verifier, which no longer holds the request")

    def _on_error_frame(self, err: ErrorFrame, arrived: float) -> None:
        """An error about one of our requests ends it. The code travels with the final event, so
        that a refusal for capacity ("busy") can be told apart from a real failure."""
        rid = err.request_id or ""
        if self._routing.declined_fallback(rid, err.code):
            log.info("target-only open of a queued request declined", request_id=rid, code=err.code)
            return
        if rid in self._routing.subs and not self._routing.owned_by(rid, self.index):
            log.info("error from a replica that does not serve the request", request_id=rid, code=err.code)
            return
        queue = self._routing.forget(rid)
        if queue is None:
            log.warning("error from the verifier", code=err.code, message=err.message, request_id=err.request_id)
            return
        text = err.message if err.code == "busy" else f"{err.code}: {err.message}"
        queue.put_nowait(Inbound(_final_event(err.request_id or "", self.node_id, "error", text), arrived, err.code))

    def _down(self, reason: str) -> None:
        """Mark the link down; in-flight requests wait for it to come back (``_resume_or_fail``)."""
        was_up = self._up.is_set()
        self._up.clear()
        self.drafters = []
        self.draft_share = 1.0
        self.sessions = 0
        self.last_error = reason
        for key in [key for key in self._routing.adopting if key[1] == self.index]:
            future = self._routing.adopting.pop(key)
            if not future.done():
                future.set_exception(ConnectionError(f"the verifier link went down: {reason}"))
        if was_up:
            self._down_since = time.monotonic()
            log.warning("verifier link down; in-flight requests wait for it", reason=reason, verifier=self.url,
                        waiting_requests=len(self._routing.of(self.index)), wait_s=RESUME_WAIT_S)
            if self._on_lost is not None:
                self._on_lost(self.index)

    def _fail_all(self, reason: str) -> None:
        """Fail every in-flight request this replica serves with a "cancelled" final event (a 503 to its client)."""
        failed = self._routing.of(self.index)
        self._down_since = None
        now = time.perf_counter()
        for rid in failed:
            queue = self._routing.forget(rid)
            final = _final_event(rid, self.node_id, "cancelled", f"lost the link to the verifier: {reason}")
            if queue is not None:
                queue.put_nowait(Inbound(final, now))
        if failed:
            log.warning("in-flight requests failed with the verifier link", reason=reason, failed_requests=len(failed))

    def _readopt(self) -> None:
        """Back on the same verifier, which kept this coordinator's requests while the link was
        down: Adopt each again. It replays their events; those relayed before are dropped (by their
        ``seq``), and the streams go on with no token lost or repeated."""
        mine = self._routing.of(self.index)
        for rid in [rid for rid in mine if rid not in self._routing.ledger]:  # nothing to check them against
            self._fail(rid, "lost the link to the verifier")
        mine = [rid for rid in mine if rid in self._routing.ledger]
        self._readopting = set(mine)
        for rid in mine:
            self._outbox.put_nowait(encode(Adopt(request_id=rid)))
        if mine:
            log.warning("link back to the same verifier; its requests adopted again", requests=len(mine))

    def _fail(self, request_id: str, reason: str) -> None:
        queue = self._routing.forget(request_id)
        if queue is not None:
            queue.put_nowait(Inbound(_final_event(request_id, self.node_id, "cancelled", reason), time.perf_counter()))

    def _resume_or_fail(self, welcome: Welcome) -> None:
        """After a (re)connect: re-open every in-flight request on a new verifier instance; on the
        same instance, adopt them again when it kept them (``orphan_grace_s``), else fail them (it
        went on without us: events were lost); then say so with ResumeDone. Queued in the fresh
        outbox, so they precede every new request."""
        previous, self._instance, self._down_since = self._instance, welcome.instance, None
        if previous is not None and (not welcome.instance or welcome.instance == previous):
            if welcome.orphan_grace_s > 0:  # it kept our requests for a resume: take them back
                self._readopt()
                self._outbox.put_nowait(encode(ResumeDone(sessions=0)))
                return
            self._fail_all(self.last_error or "reconnected to the same verifier")
        mine = self._routing.of(self.index)
        frames = self._routing.ledger.reopen(mine) if mine else []
        untracked = [rid for rid in mine if rid not in self._routing.ledger]
        for rid in untracked:  # subscribed without how they were opened: nothing to re-open them from
            queue = self._routing.forget(rid)
            if queue is not None:
                queue.put_nowait(Inbound(_final_event(
                    rid, self.node_id, "cancelled", "lost the link to the verifier"), time.perf_counter()))
        for frame in frames:
            self._routing.where[frame.request_id] = self.index
            self._outbox.put_nowait(encode(frame))
        self._outbox.put_nowait(encode(ResumeDone(sessions=len(frames))))
        if frames:
            log.warning("re-opened in-flight requests on a restarted verifier", requests=len(frames),
                        verifier_instance=welcome.instance,
                        relayed_tokens=sum(len(f.resume.generated_ids) for f in frames if f.resume is not None))


def _final_event(request_id: str, origin: str, reason: FinishReason, error: str) -> TokenEvent:
    return TokenEvent(request_id=request_id, origin=origin, token_ids=[], text="", finished=True,
                      finish_reason=reason, error=error)
