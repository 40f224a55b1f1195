"""The verifier's WebSocket endpoints, bearer-token auth and the registry of connected peers.

``/v1/drafter``   drafters: Hello -> Welcome (tokenizer fingerprint checked), then sessions
``/v1/frontend``  coordinators: Hello -> Welcome, then TokenEvents/FleetStatus flow to them
``/health``       plain HTTP 200 for liveness probes

Every frame is decoded with ``shared.protocol.decode``; a bad frame is answered with an
ErrorFrame and the connection keeps going. Each connection has its own outbound queue and
writer task, so a slow peer never blocks the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
from dataclasses import dataclass, field
from http import HTTPStatus

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from services.verifier.engine import Engine
from shared.log import get_logger
from shared.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    ErrorFrame,
    FleetStatus,
    Hello,
    Message,
    ProtocolError,
    Refused,
    Welcome,
    decode,
    encode,
)

log = get_logger("verifier.server")
PATH_ROLES = {"/v1/drafter": "drafter", "/v1/frontend": "frontend"}
HELLO_TIMEOUT_S = 10.0
FLEET_STATUS_EVERY_S = 5.0
_conn_ids = itertools.count(1)


@dataclass
class Peer:
    conn_id: str
    role: str
    node_id: str
    model: str
    outbox: asyncio.Queue[Message | None] = field(default_factory=asyncio.Queue)


class Hub:
    """Connected peers, and the Outbox the engine sends through."""

    def __init__(self, target_model: str, fingerprint: str, max_model_len: int, max_draft_tokens: int,
                 auth_token: str) -> None:
        self.peers: dict[str, Peer] = {}
        self.welcome = Welcome(node_id="verifier", protocol_version=PROTOCOL_VERSION, target_model=target_model,
                               tokenizer_fingerprint=fingerprint, max_model_len=max_model_len,
                               max_draft_tokens=max_draft_tokens)
        self.auth_token = auth_token
        self.engine: Engine | None = None

    # --- Outbox ------------------------------------------------------------------------

    def to_conn(self, conn_id: str, msg: Message) -> None:
        peer = self.peers.get(conn_id)
        if peer is not None:
            peer.outbox.put_nowait(msg)

    def to_frontend(self, origin: str, msg: Message) -> None:
        for peer in self.peers.values():
            if peer.role == "frontend" and peer.node_id == origin:
                peer.outbox.put_nowait(msg)

    def fleet_status(self) -> FleetStatus:
        drafters = sorted(p.node_id for p in self.peers.values() if p.role == "drafter")
        sessions = len(self.engine.sessions) if self.engine else 0
        return FleetStatus(drafters=drafters, sessions=sessions, target_model=self.welcome.target_model)

    def broadcast_fleet(self) -> None:
        status = self.fleet_status()
        for peer in self.peers.values():
            if peer.role == "frontend":
                peer.outbox.put_nowait(status)

    # --- HTTP layer ----------------------------------------------------------------------

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path == "/health":
            return connection.respond(HTTPStatus.OK, "ok\n")
        if request.path not in PATH_ROLES:
            return connection.respond(HTTPStatus.NOT_FOUND, "use /v1/drafter or /v1/frontend\n")
        if self.auth_token:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.auth_token}".encode()):
                log.warning("refused unauthenticated peer", path=request.path)
                return connection.respond(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token\n")
        return None

    # --- one connection --------------------------------------------------------------------

    async def handle(self, ws: ServerConnection) -> None:
        role = PATH_ROLES[ws.request.path if ws.request else ""]
        hello = await self._handshake(ws, role)
        if hello is None:
            return
        peer = Peer(f"{role}-{next(_conn_ids)}", role, hello.node_id, hello.model)
        self.peers[peer.conn_id] = peer
        log.info("peer connected", conn=peer.conn_id, node_id=peer.node_id, model=peer.model)
        peer.outbox.put_nowait(self.welcome)
        writer = asyncio.create_task(self._write(ws, peer))
        if role == "drafter":
            self.broadcast_fleet()
        else:
            peer.outbox.put_nowait(self.fleet_status())
        try:
            await self._read(ws, peer)
        finally:
            self.peers.pop(peer.conn_id, None)
            peer.outbox.put_nowait(None)
            writer.cancel()
            if role == "drafter" and self.engine is not None:
                self.engine.submit(peer.conn_id, "gone", None)
            self.broadcast_fleet()
            log.info("peer disconnected", conn=peer.conn_id, node_id=peer.node_id)

    async def _handshake(self, ws: ServerConnection, role: str) -> Hello | None:
        try:
            raw = await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT_S)
            hello = decode(raw)
        except (TimeoutError, ConnectionClosed):
            return None
        except ProtocolError as exc:
            await self._refuse(ws, "bad_hello", f"first frame must be Hello: {exc}")
            return None
        problem = self._check_hello(hello, role)
        if problem is not None:
            await self._refuse(ws, *problem)
            return None
        assert isinstance(hello, Hello)
        return hello

    def _check_hello(self, hello: Message, role: str) -> tuple[str, str] | None:
        if not isinstance(hello, Hello) or hello.role != role:
            return "bad_hello", f"first frame on this path must be Hello(role={role!r})"
        if hello.protocol_version != PROTOCOL_VERSION:
            return "bad_version", (f"peer speaks protocol v{hello.protocol_version}, this verifier speaks "
                                   f"v{PROTOCOL_VERSION}; run matching specfleet versions")
        fp = self.welcome.tokenizer_fingerprint
        if role == "drafter" and hello.tokenizer_fingerprint != fp:
            return "bad_tokenizer", (
                f"draft model {hello.model!r} has tokenizer fingerprint {hello.tokenizer_fingerprint!r} but the "
                f"target {self.welcome.target_model!r} has {fp!r}: a drafter must use exactly the target's "
                "tokenizer (same vocabulary and special tokens)")
        return None

    async def _refuse(self, ws: ServerConnection, code: str, message: str) -> None:
        log.warning("refused peer", code=code, reason=message)
        with contextlib.suppress(ConnectionClosed):
            await ws.send(encode(Refused(code=code, message=message)))  # type: ignore[arg-type]
            await ws.close(1008, code)

    async def _read(self, ws: ServerConnection, peer: Peer) -> None:
        assert self.engine is not None
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                try:
                    msg = decode(raw)
                except ProtocolError as exc:
                    peer.outbox.put_nowait(ErrorFrame(code="bad_frame", message=str(exc)))
                    continue
                self.engine.submit(peer.conn_id, peer.role, msg)

    async def _write(self, ws: ServerConnection, peer: Peer) -> None:
        with contextlib.suppress(ConnectionClosed):
            while (msg := await peer.outbox.get()) is not None:
                await ws.send(encode(msg))


async def start_server(hub: Hub, host: str, port: int) -> Server:
    server = await serve(hub.handle, host, port, process_request=hub.process_request,
                         max_size=MAX_FRAME_BYTES, ping_interval=20, ping_timeout=60)
    return server


async def fleet_status_loop(hub: Hub) -> None:
    """Frontends also get a periodic FleetStatus, so their view never goes stale."""
    while True:
        await asyncio.sleep(FLEET_STATUS_EVERY_S)
        hub.broadcast_fleet()
