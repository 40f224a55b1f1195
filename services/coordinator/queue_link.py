"""The server side of the drafters' queue link: ``/internal/queue`` on the coordinator.

Without Redis, requests wait in the coordinator's in-process MemoryQueue; drafters consume it
through this WebSocket (client: ``shared/queue_link.py``). Per connection:

1. bearer token check (when ``auth_token`` is set), then Hello -> Welcome; a failure gets a
   Refused frame saying what to fix and close code 1008 (policy violation);
2. QueuePull and QueueAck are served concurrently: a pull waits in the queue while ACKs for
   earlier requests keep flowing;
3. a malformed or unexpected frame gets an ErrorFrame and the link stays up;
4. when the link ends, for whatever reason, every request delivered over it and not ACKed is
   released back to the front of the queue, so a crashed drafter loses no request.

Each connection is its own consumer (``<node_id>#<random suffix>``): a drafter that reconnects
must not inherit, or be blamed for, the deliveries of its previous link.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
from collections.abc import Mapping
from typing import Any, Literal

from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

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
    Refused,
    Welcome,
    decode,
    encode,
)
from shared.queue import QueueError, RequestQueue

log = get_logger("coordinator.queue_link")

HELLO_TIMEOUT_S = 10.0
#: Pulls a link may have waiting at once; a well-behaved client keeps one.
MAX_OUTSTANDING_PULLS = 64
POLICY_VIOLATION = 1008
GOING_AWAY = 1001
#: What a send or close raises once the peer is gone.
_GONE = (WebSocketDisconnect, RuntimeError, OSError)


def make_queue_router(queue: RequestQueue, auth_token: str, *, node_id: str = "coordinator") -> APIRouter:
    """A router with the ``/internal/queue`` WebSocket serving ``queue`` (the MemoryQueue)."""
    router = APIRouter()

    @router.websocket("/internal/queue")
    async def queue_link(websocket: WebSocket) -> None:
        await websocket.accept()
        hello = await _handshake(websocket, auth_token)
        if hello is None:
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
        link = _QueueLink(websocket, queue, consumer)
        if await link.send(welcome):
            await link.run()

    return router


async def _handshake(ws: WebSocket, auth_token: str) -> Hello | None:
    """The drafter's Hello if the link is acceptable; otherwise refuse it and return None."""
    if auth_token:
        expected = f"Bearer {auth_token}".encode()
        given = ws.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            await _refuse(
                ws,
                "unauthorized",
                "missing or wrong 'Authorization: Bearer' token; set the drafter's auth_token to the coordinator's",
            )
            return None
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

    def __init__(self, ws: WebSocket, queue: RequestQueue, consumer: str) -> None:
        self._ws = ws
        self._queue = queue
        self._consumer = consumer
        # Bounded, like everything a link buffers: a pull is answered only when the queue has work, so
        # a client could otherwise pile them up; deliveries per pull are capped by QueuePull.max_items
        # and each frame is sent (awaited) before the next pull is served.
        self._pulls: asyncio.Queue[int] = asyncio.Queue(maxsize=MAX_OUTSTANDING_PULLS)
        self._send_lock = asyncio.Lock()

    async def run(self) -> None:
        log.info("queue link open", consumer=self._consumer, client=str(self._ws.client))
        receiver = asyncio.create_task(self._receive_loop(), name=f"queue-link-recv-{self._consumer}")
        puller = asyncio.create_task(self._serve_pulls(), name=f"queue-link-pull-{self._consumer}")
        tasks = {receiver, puller}
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
        if isinstance(msg, QueuePull):
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
            try:
                await self._queue.ack(self._consumer, msg.delivery_id)
            except QueueError as exc:
                await self.send(ErrorFrame(code="ack_failed", message=str(exc)))
        else:
            await self.send(
                ErrorFrame(
                    code="unexpected_frame",
                    message=(
                        f"a {type(msg).__name__} frame is not valid on the queue link; send queue_pull or queue_ack"
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
                frame = QueueDelivery(delivery_id=delivery.delivery_id, request=delivery.request)
                if not await self.send(frame):
                    return  # link gone: run() releases what this link still holds

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(*_GONE):
            await self._ws.close(code=code, reason=reason)
