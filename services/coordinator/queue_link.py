"""The server side of the drafters' queue link: ``/internal/queue`` on the coordinator.

Without Redis, requests wait in the coordinator's in-process MemoryQueue; drafters consume it
through this WebSocket (client: ``shared/queue_link.py``). Per connection:

1. bearer token check (``shared.credentials``: the shared token, or in per-drafter mode the
   drafter's own token, whose identity the Hello must name), then Hello -> Welcome; a failure gets
   a Refused frame saying what to fix and close code 1008 (policy violation); a per-drafter
   credential removed from the file closes the link within a second;
2. QueuePull and QueueAck are served concurrently: a pull waits in the queue while ACKs for
   earlier requests keep flowing; the room a pull or a QueueRoom says (the sessions the drafter can
   still take) is noted in the MemoryQueue as it arrives, and so is the machine the Hello names
   (``Hello.site``: the queue fills one drafter of a machine before the next);
3. a malformed or unexpected frame gets an ErrorFrame and the link stays up;
4. when the link ends, for whatever reason, every request delivered over it and not ACKed is
   released back to the front of the queue, so a crashed drafter loses no request;
5. in per-drafter mode a drafter may ACK only deliveries made to its own identity (else any
   drafter could delete requests waiting for, or held by, another).

Each connection is its own consumer (``<node_id>#<random suffix>``): a drafter that reconnects
must not inherit, or be blamed for, the deliveries of its previous link.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Mapping
from typing import Any, Literal

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from shared.credentials import Credentials, Identity, check_hello_identity
from shared.log import get_logger
from shared.protocol import (
    PROTOCOL_VERSION,
    ErrorFrame,
    Hello,
    Message,
    ProtocolError,
    QueueAck,
    QueueDelivery,
    QueuePull,
    QueueRoom,
    Refused,
    Welcome,
    decode,
    encode,
)
from shared.queue import QueueError, RequestQueue
from shared.queue_memory import MemoryQueue

log = get_logger("coordinator.queue_link")

HELLO_TIMEOUT_S = 10.0
#: Pulls a link may have waiting at once; a well-behaved client keeps one.
MAX_OUTSTANDING_PULLS = 64
POLICY_VIOLATION = 1008
GOING_AWAY = 1001
#: What a send or close raises once the peer is gone.
_GONE = (WebSocketDisconnect, RuntimeError, OSError)


REVOCATION_CHECK_S = 1.0
#: per-drafter mode: delivery id -> identity it was delivered to (most remembered at once)
MAX_TRACKED_DELIVERIES = 1 << 20


def make_queue_router(queue: RequestQueue, auth: Credentials | str, *, node_id: str = "coordinator") -> APIRouter:
    """A router with the ``/internal/queue`` WebSocket serving ``queue`` (the MemoryQueue)."""
    router = APIRouter()
    credentials = auth if isinstance(auth, Credentials) else Credentials(auth)
    delivered_to: dict[str, str] = {}

    @router.websocket("/internal/queue")
    async def queue_link(websocket: WebSocket) -> None:
        await websocket.accept()
        identity = credentials.authenticate(websocket.headers.get("authorization"), "drafter")
        if identity is None:
            await _refuse(websocket, "unauthorized",
                          credentials.refusal(websocket.headers.get("authorization"), "drafter"))
            return
        hello = await _handshake(websocket)
        if hello is None:
            return
        problem = check_hello_identity(identity, hello.node_id)
        if problem:
            await _refuse(websocket, "unauthorized", problem)
            return
        consumer = f"{hello.node_id}#{secrets.token_hex(4)}"
        welcome = Welcome(
            node_id=node_id,
            protocol_version=PROTOCOL_VERSION,
            target_model="",
            tokenizer_fingerprint="",
            max_model_len=0,
            max_draft_tokens=0,
        )
        link = _QueueLink(websocket, queue, consumer, credentials, identity,
                          delivered_to if identity.name is not None else None, hello.site)
        if await link.send(welcome):
            await link.run()

    return router


async def _handshake(ws: WebSocket) -> Hello | None:
    """The drafter's Hello if the link is acceptable; otherwise refuse it and return None."""
    try:
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            message = await ws.receive()
    except TimeoutError:
        await _refuse(ws, "bad_hello", f"no hello frame within {HELLO_TIMEOUT_S:.0f} s")
        return None
    if message["type"] == "websocket.disconnect":
        return None
    try:
        hello = decode(_payload(message))
    except ProtocolError as exc:
        await _refuse(ws, "bad_hello", f"the first frame must be a hello: {exc}")
        return None
    if not isinstance(hello, Hello) or hello.role != "drafter":
        await _refuse(ws, "bad_hello", "the first frame must be a hello with role 'drafter'")
        return None
    if hello.protocol_version != PROTOCOL_VERSION:
        await _refuse(
            ws,
            "bad_version",
            f"drafter speaks protocol version {hello.protocol_version}, "
            f"this coordinator speaks {PROTOCOL_VERSION}; upgrade the older side",
        )
        return None
    return hello


async def _refuse(ws: WebSocket, code: Literal["unauthorized", "bad_hello", "bad_version"], message: str) -> None:
    log.warning("queue link refused", code=code, reason=message, client=str(ws.client))
    with contextlib.suppress(*_GONE):  # if the peer is already gone, there is nobody to tell
        await ws.send_bytes(encode(Refused(code=code, message=message)))
        await ws.close(code=POLICY_VIOLATION, reason=code)


def _payload(message: Mapping[str, Any]) -> bytes | str:
    data = message.get("bytes")
    if isinstance(data, bytes):
        return data
    text = message.get("text")
    return text if isinstance(text, str) else b""


class _QueueLink:
    """One accepted link: a receive loop and a pull server, and the release when it ends."""

    def __init__(self, ws: WebSocket, queue: RequestQueue, consumer: str, credentials: Credentials,
                 identity: Identity, delivered_to: dict[str, str] | None, site: str = "") -> None:
        self._ws = ws
        self._site = site  # the machine the drafter drafts on (Hello.site): the queue's turns
        self._queue = queue
        self._consumer = consumer
        self._credentials = credentials
        self._identity = identity
        self._delivered_to = delivered_to  # None: shared-token mode, ACKs are consumer-agnostic
        # Bounded, like everything a link buffers: a pull is answered only when the queue has work, so
        # a client could otherwise pile them up; deliveries per pull are capped by QueuePull.max_items
        # and each frame is sent (awaited) before the next pull is served.
        self._pulls: asyncio.Queue[int] = asyncio.Queue(maxsize=MAX_OUTSTANDING_PULLS)
        self._send_lock = asyncio.Lock()

    async def run(self) -> None:
        log.info("queue link open", consumer=self._consumer, client=str(self._ws.client), site=self._site)
        if isinstance(self._queue, MemoryQueue):
            self._queue.note_site(self._consumer, self._site)  # release() below forgets it
        receiver = asyncio.create_task(self._receive_loop(), name=f"queue-link-recv-{self._consumer}")
        puller = asyncio.create_task(self._serve_pulls(), name=f"queue-link-pull-{self._consumer}")
        tasks = {receiver, puller}
        if self._identity.name is not None:
            tasks.add(asyncio.create_task(self._watch_revocation(), name=f"queue-link-auth-{self._consumer}"))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            await self._queue.release(self._consumer)
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    log.error("queue link task failed", consumer=self._consumer, error=repr(task.exception()))
            log.info("queue link closed; unacknowledged requests released", consumer=self._consumer)

    async def send(self, msg: Message) -> bool:
        """Send one frame; False when the peer is gone."""
        try:
            async with self._send_lock:
                await self._ws.send_bytes(encode(msg))
        except _GONE:
            return False
        return True

    async def _receive_loop(self) -> None:
        while True:
            message = await self._ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            try:
                msg = decode(_payload(message))
            except ProtocolError as exc:
                await self.send(ErrorFrame(code="bad_frame", message=str(exc)))
                continue
            await self._handle(msg)

    async def _handle(self, msg: Message) -> None:
        if isinstance(msg, QueuePull | QueueRoom):
            # counted as it arrives: a pull may wait behind the one being served, and a QueueRoom
            # updates the one that waits
            if isinstance(self._queue, MemoryQueue):
                self._queue.note_room(self._consumer, msg.room if isinstance(msg, QueueRoom) else msg.room or None)
            if isinstance(msg, QueueRoom):
                return
            try:
                self._pulls.put_nowait(msg.max_items)
            except asyncio.QueueFull:
                await self.send(
                    ErrorFrame(
                        code="too_many_pulls",
                        message=(f"{MAX_OUTSTANDING_PULLS} pulls already wait; pull again after deliveries arrive"),
                    )
                )
        elif isinstance(msg, QueueAck):
            owner = self._delivered_to.get(msg.delivery_id) if self._delivered_to is not None else None
            if self._delivered_to is not None and owner != self._identity.name:
                log.warning("queue ack for another drafter's delivery refused", consumer=self._consumer,
                            delivery_id=msg.delivery_id[:64])
                await self.send(ErrorFrame(code="not_owner", message=(
                    f"delivery {msg.delivery_id[:64]!r} was not delivered to this drafter; a drafter may ACK only "
                    "its own deliveries")))
                return
            if self._delivered_to is not None:
                self._delivered_to.pop(msg.delivery_id, None)
            try:
                await self._queue.ack(self._consumer, msg.delivery_id)
            except QueueError as exc:
                await self.send(ErrorFrame(code="ack_failed", message=str(exc)))
        else:
            await self.send(
                ErrorFrame(
                    code="unexpected_frame",
                    message=(
                        f"a {type(msg).__name__} frame is not valid on the queue link; "
                        "send queue_pull, queue_room or queue_ack"
                    ),
                )
            )

    async def _serve_pulls(self) -> None:
        """Answer pulls in order: each waits for at least one request, then sends them all."""
        while True:
            max_items = await self._pulls.get()
            try:
                deliveries = await self._queue.get(self._consumer, max_items, None)
            except QueueError as exc:
                await self.send(ErrorFrame(code="queue_closed", message=str(exc)))
                await self._close(GOING_AWAY, "queue closed")
                return
            for delivery in deliveries:
                if self._delivered_to is not None and self._identity.name is not None:
                    if len(self._delivered_to) >= MAX_TRACKED_DELIVERIES:
                        self._delivered_to.pop(next(iter(self._delivered_to)))
                    self._delivered_to[delivery.delivery_id] = self._identity.name
                frame = QueueDelivery(delivery_id=delivery.delivery_id, request=delivery.request)
                if not await self.send(frame):
                    return  # link gone: run() releases what this link still holds

    async def _watch_revocation(self) -> None:
        """Return (ending the link) once this drafter's credential left the credentials file."""
        while self._credentials.still_valid(self._identity):
            await asyncio.sleep(REVOCATION_CHECK_S)
        log.warning("credential revoked; closing the queue link", consumer=self._consumer)
        await self.send(Refused(code="unauthorized", message="this drafter's credential was revoked"))
        await self._close(POLICY_VIOLATION, "credential revoked")

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(*_GONE):
            await self._ws.close(code=code, reason=reason)
