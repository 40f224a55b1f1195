"""A drafter's consumer view of the coordinator's in-process queue, over WebSocket.

The coordinator serves ``/internal/queue`` (``services/coordinator/queue_link.py``). The link
speaks Hello -> Welcome, then QueuePull -> QueueDelivery* and QueueAck. The server answers
one pull with between one and ``max_items`` deliveries, whenever they become available.

Nothing is ever lost, whatever the timing:

* A pull stays outstanding after a ``get`` times out; deliveries that answer it later are
  buffered and handed out by the next ``get`` (which then sends no new pull).
* When the link drops, the server puts every unacknowledged delivery of that link back at the
  front of its queue, so the client drops its buffer too and simply reconnects.
* Requests already handed to the caller keep their delivery id; if one comes back on the new
  link it is not handed out twice (the caller is still working on it), and the caller's ACK
  then goes over the new link. ACKs that cannot be sent are kept and sent on reconnect (the
  server's ACK is consumer-agnostic, so a late ACK still prevents a duplicate run).

Errors: ``get`` raises QueueError when the coordinator cannot be reached, refuses the link
(bad token, protocol version) or the link drops while it waits. Each call re-opens a dropped
link first, so callers just retry after a pause (the drafter's ``reconnect_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from shared.log import get_logger
from shared.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    ErrorFrame,
    Hello,
    ProtocolError,
    QueueAck,
    QueueDelivery,
    QueuedRequest,
    QueuePull,
    QueueRoom,
    Refused,
    Welcome,
    decode,
    encode,
)
from shared.queue import Delivery, QueueError
from shared.tls import ssl_kwargs

log = get_logger("queue.link")
_MAX_PULL = 1024  # QueuePull.max_items bound in the protocol
_MAX_ROOM = 100_000  # QueuePull.room's


class QueueLinkClient:
    """RequestQueue (consumer side only) backed by a coordinator's ``/internal/queue``."""

    def __init__(self, url: str, auth_token: str = "", *, open_timeout_s: float = 10.0,
                 tls: ssl.SSLContext | None = None, site: str = "") -> None:
        self._url = url
        self._site = site  # the machine this drafter drafts on (Hello.site)
        self._tls = tls  # wss://: the CA-pinned client context (shared.tls.client_context)
        self._auth_token = auth_token
        self._open_timeout_s = open_timeout_s
        self._consumer: str | None = None
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._buffer: deque[Delivery] = deque()  # delivered to this link, not yet handed out
        self._held: set[str] = set()  # handed out to the caller, not yet acknowledged
        self._unsent_acks: list[str] = []
        self._pull_outstanding = False
        self._said_room = 0  # the room the coordinator counts for us: the last said, less what it delivered since
        self._changed = asyncio.Condition()
        self._connect_lock = asyncio.Lock()
        self._closed = False

    async def put(self, request: QueuedRequest) -> None:
        raise QueueError(
            "the coordinator's queue link only serves consumers; producers need the in-process "
            "queue (memory://) or Redis (redis://)"
        )

    async def get(self, consumer: str, max_items: int = 1, timeout_s: float | None = None,
                  room: int = 0) -> list[Delivery]:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self._bind(consumer)
        room = min(max(0, room), _MAX_ROOM)
        try:
            async with asyncio.timeout(timeout_s):
                ws = await self._connected()
                while not self._buffer:
                    if self._ws is not ws:
                        raise QueueError(
                            f"the queue link to {self._url} dropped (close code {ws.close_code}, "
                            f"{ws.close_reason or 'no reason'}); the next call reconnects"
                        )
                    if not self._pull_outstanding:
                        # Marked before the send: the answer may arrive while send() awaits.
                        self._pull_outstanding, self._said_room = True, room
                        if not await self._send(ws, QueuePull(max_items=min(max_items, _MAX_PULL), room=room)):
                            self._pull_outstanding = False
                    elif room and room != self._said_room:  # sessions ended while our pull waited
                        self._said_room = room
                        await self._send(ws, QueueRoom(room=room))
                    await self._wait_for_change(ws)
                return self._hand_out(max_items)
        except TimeoutError:
            return []

    async def ack(self, consumer: str, delivery_id: str) -> None:
        """Send the ACK now if the link is (or can be re-)opened, else on the next connect."""
        self._bind(consumer)
        self._held.discard(delivery_id)
        try:
            ws = await self._connected()
        except QueueError as exc:
            log.warning("queue link down; ACK kept for the next connect", delivery_id=delivery_id, reason=str(exc))
            self._unsent_acks.append(delivery_id)
            return
        if not await self._send(ws, QueueAck(delivery_id=delivery_id)):
            self._unsent_acks.append(delivery_id)

    async def release(self, consumer: str) -> None:
        """Close the link: the coordinator then re-queues everything it delivered over it."""
        self._bind(consumer)
        self._held.clear()
        await self._disconnect()

    async def depth(self) -> int:
        """Deliveries buffered on this link but not handed out yet (the coordinator's own queue
        depth is on its /metrics; a consumer cannot see it)."""
        return len(self._buffer)

    async def close(self) -> None:
        self._closed = True
        await self._disconnect()

    # --- internals ------------------------------------------------------------------------

    def _bind(self, consumer: str) -> None:
        if self._consumer is None:
            self._consumer = consumer
        elif consumer != self._consumer:
            raise QueueError(
                f"this queue link serves consumer {self._consumer!r}; open another QueueLinkClient for {consumer!r}"
            )

    async def _wait_for_change(self, ws: ClientConnection) -> None:
        """Until a delivery is buffered or the link ``ws`` is gone."""
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._buffer) or self._ws is not ws)

    def _hand_out(self, max_items: int) -> list[Delivery]:
        out = [self._buffer.popleft() for _ in range(min(max_items, len(self._buffer)))]
        self._held.update(d.delivery_id for d in out)
        return out

    async def _connected(self) -> ClientConnection:
        if self._closed:
            raise QueueError("the queue link client is closed")
        async with self._connect_lock:
            if self._ws is None:
                ws = await self._open()
                self._ws = ws
                self._reader = asyncio.create_task(self._read(ws), name="queue-link-reader")
                acks, self._unsent_acks = self._unsent_acks, []
                for delivery_id in acks:
                    if not await self._send(ws, QueueAck(delivery_id=delivery_id)):
                        self._unsent_acks.append(delivery_id)
            return self._ws

    async def _open(self) -> ClientConnection:
        headers = {"Authorization": f"Bearer {self._auth_token}"} if self._auth_token else {}
        try:
            ws = await connect(
                self._url, additional_headers=headers, max_size=MAX_FRAME_BYTES, open_timeout=self._open_timeout_s,
                compression=None, **ssl_kwargs(self._tls),
            )
        except InvalidStatus as exc:
            raise QueueError(
                f"the coordinator at {self._url} rejected the queue link with HTTP "
                f"{exc.response.status_code}; check the URL path (/internal/queue) and auth_token"
            ) from None
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
            raise QueueError(
                f"cannot reach the coordinator's queue link at {self._url}: {exc}; is the coordinator running?"
            ) from None
        try:
            return await self._handshake(ws)
        except BaseException:
            await ws.close()
            raise

    async def _handshake(self, ws: ClientConnection) -> ClientConnection:
        assert self._consumer is not None
        hello = Hello(role="drafter", node_id=self._consumer, protocol_version=PROTOCOL_VERSION, site=self._site)
        with contextlib.suppress(ConnectionClosed):  # refused already? the Refused frame waits below
            await ws.send(encode(hello))
        try:
            async with asyncio.timeout(self._open_timeout_s):
                reply = decode(await ws.recv())
        except (ConnectionClosed, ProtocolError, TimeoutError) as exc:
            raise QueueError(f"queue link handshake with {self._url} failed: {exc}") from None
        if isinstance(reply, Refused):
            raise QueueError(f"the coordinator refused the queue link ({reply.code}): {reply.message}")
        if not isinstance(reply, Welcome):
            raise QueueError(f"queue link handshake with {self._url} failed: expected welcome, got {reply!r}")
        log.info("queue link open", url=self._url, consumer=self._consumer, coordinator=reply.node_id)
        return ws

    async def _send(self, ws: ClientConnection, msg: QueuePull | QueueRoom | QueueAck) -> bool:
        """Send one frame; False if the link is gone (the reader notices and cleans up)."""
        try:
            await ws.send(encode(msg))
        except ConnectionClosed:
            return False
        return True

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for frame in ws:
                await self._on_frame(frame)
        except ConnectionClosed as exc:
            log.warning("queue link dropped", url=self._url, reason=str(exc))
        finally:
            await self._dropped(ws)

    async def _on_frame(self, frame: bytes | str) -> None:
        try:
            msg = decode(frame)
        except ProtocolError as exc:
            log.warning("ignoring a malformed frame from the coordinator", reason=str(exc))
            return
        if isinstance(msg, QueueDelivery):
            self._pull_outstanding = False
            self._said_room = max(0, self._said_room - 1)  # as the coordinator counts it
            if msg.delivery_id in self._held:
                # Re-delivered after a reconnect while the caller still works on it: this link
                # now holds it, and the caller's ACK will go here.
                log.info("request re-delivered while still in progress here", delivery_id=msg.delivery_id)
                return
            self._buffer.append(Delivery(msg.delivery_id, msg.request))
            async with self._changed:
                self._changed.notify_all()
        elif isinstance(msg, ErrorFrame):
            log.warning("coordinator reported a queue link error", code=msg.code, message=msg.message)
        else:
            log.warning("ignoring an unexpected frame on the queue link", type=type(msg).__name__)

    async def _dropped(self, ws: ClientConnection) -> None:
        if self._ws is not ws:
            return
        self._ws = None
        self._buffer.clear()  # the server re-queues them for whoever pulls next
        self._pull_outstanding = False
        async with self._changed:
            self._changed.notify_all()

    async def _disconnect(self) -> None:
        ws, reader = self._ws, self._reader
        if ws is not None:
            await ws.close()
        if reader is not None:
            await reader
        self._reader = None
