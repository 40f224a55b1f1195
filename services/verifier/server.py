"""The verifier's WebSocket endpoints, bearer-token auth and the registry of connected peers.

``/v1/drafter``   drafters: Hello -> Welcome (tokenizer fingerprint checked), then sessions
``/v1/frontend``  coordinators: Hello -> Welcome, then TokenEvents/FleetStatus flow to them
``/health``       plain HTTP 200 for liveness probes
``/metrics``      Prometheus text (``services/verifier/metrics.py``)
``/status``       JSON: the allocation, batching and trim policies and their live estimates
``/fleet``        JSON for the coordinators' dashboards (``fleet_view``); a frontend's credentials

Peers authenticate with a bearer token (``shared.credentials``): the fleet's shared token, or in
per-drafter mode each drafter's own token, which must match the identity its Hello names. Each
drafter connection carries a trust flag: an untrusted drafter's q is ignored (its drafts are
verified ids-only, lossless however it chose them). A credential removed from the file closes
the connections that used it within a second (``revocation_loop``).

Every frame is decoded with ``shared.protocol.decode``; a bad frame is answered with an
ErrorFrame and the connection keeps going. Each connection has its own bounded outbound queue
and writer task, so a slow peer never blocks the engine; a peer that falls
``OUTBOX_FRAMES`` frames behind is disconnected (its sessions are handled as for any lost peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import secrets
import ssl
import time
from dataclasses import dataclass, field
from http import HTTPStatus

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from services.verifier.config import TRUST_MODES
from services.verifier.fleet_view import EngineInfo, fleet_view
from services.verifier.intake import Intake
from services.verifier.metrics import VerifierMetrics
from services.verifier.sessions import Routes
from shared.credentials import Credentials, Identity, check_hello_identity
from shared.log import get_logger
from shared.models import Vocabulary
from shared.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Batchable,
    ErrorFrame,
    FleetStatus,
    Hello,
    Message,
    ProtocolError,
    Refused,
    Welcome,
    decode,
    encode,
    encode_many,
    unpack,
)

log = get_logger("verifier.server")
PATH_ROLES = {"/v1/drafter": "drafter", "/v1/frontend": "frontend"}
HELLO_TIMEOUT_S = 10.0
FLEET_STATUS_EVERY_S = 5.0
DRAFT_SHARE_CHECK_S = 0.25
_conn_ids = itertools.count(1)
#: frames a peer may fall behind before it is disconnected as too slow
OUTBOX_FRAMES = 8192
REVOCATION_CHECK_S = 1.0


@dataclass
class Peer:
    conn_id: str
    role: str
    node_id: str
    model: str
    ws: ServerConnection
    identity: Identity = field(default_factory=lambda: Identity(None))
    trusted: bool = True
    outbox: asyncio.Queue[bytes | None] = field(default_factory=lambda: asyncio.Queue(OUTBOX_FRAMES))
    connected_at: float = field(default_factory=time.time)  # wall clock, for the dashboard

    def put(self, frame: bytes) -> None:
        try:
            self.outbox.put_nowait(frame)
        except asyncio.QueueFull:
            log.error("peer fell too far behind; disconnecting it", conn=self.conn_id, node_id=self.node_id,
                      frames=OUTBOX_FRAMES)
            self.ws.transport.abort()


def make_welcome(target_model: str, vocabulary: Vocabulary | str, max_model_len: int, max_draft_tokens: int,
                 conditional_drafts: bool = False, orphan_grace_s: float = 0.0) -> Welcome:
    """What this verifier tells every peer it admits (a fresh instance id per process).
    ``vocabulary``: the target's, or just its fingerprint."""
    words = vocabulary if isinstance(vocabulary, Vocabulary) else Vocabulary(0, vocabulary, "", "")
    return Welcome(node_id="verifier", protocol_version=PROTOCOL_VERSION, target_model=target_model,
                   tokenizer_fingerprint=words.fingerprint, max_model_len=max_model_len,
                   max_draft_tokens=max_draft_tokens, instance=secrets.token_hex(8),
                   conditional_drafts=conditional_drafts, orphan_grace_s=orphan_grace_s,
                   ids_fingerprint=words.ids_fingerprint, vocabulary=words.summary)


def vocabulary_problem(hello: Hello, welcome: Welcome) -> str | None:
    """Why a drafter's token ids are not the target's (None: they are). The same fingerprint joins;
    so does the same id -> token table with other special tokens (a GGUF copy's converter may name
    another bos: the drafter then stops drafting at its own end tokens, which changes no text)."""
    if hello.tokenizer_fingerprint == welcome.tokenizer_fingerprint:
        return None
    if hello.ids_fingerprint and hello.ids_fingerprint == welcome.ids_fingerprint:
        log.info("drafter joins with the target's token ids and other special tokens", node_id=hello.node_id,
                 draft_model=hello.model, vocabulary=hello.vocabulary)
        return None
    draft = hello.vocabulary or f"tokenizer fingerprint {hello.tokenizer_fingerprint!r}"
    target = welcome.vocabulary or f"tokenizer fingerprint {welcome.tokenizer_fingerprint!r}"
    return (f"draft model {hello.model!r} has another vocabulary than the target {welcome.target_model!r}: the "
            f"draft's is [{draft}], the target's is [{target}]. A drafter must draft in the target's token ids: "
            "use a draft made from the target's tokenizer (for a GGUF draft, a copy of the target: `specfleet "
            "fetch-model` makes them)")


class Hub:
    """Connected peers: what the output side sends through, and the WebSocket handlers."""

    def __init__(self, welcome: Welcome, credentials: Credentials | str, routes: Routes, metrics: VerifierMetrics,
                 drafter_trust: str = "trusted") -> None:
        self.peers: dict[str, Peer] = {}
        self.welcome = welcome
        self.credentials = credentials if isinstance(credentials, Credentials) else Credentials(credentials)
        if drafter_trust not in TRUST_MODES:
            raise ValueError(f"--drafter-trust must be one of {', '.join(TRUST_MODES)}, got {drafter_trust!r}")
        self.default_trust = drafter_trust == "trusted"
        self.routes = routes
        self.metrics = metrics
        self.intake: Intake | None = None
        self.last_share = 1.0  # ``draft_share`` of the last FleetStatus broadcast
        self.engine = EngineInfo("torch", welcome.target_model, "", "")  # main fills in what it loaded

    # --- sending -------------------------------------------------------------------------

    def node_name(self, conn_id: str) -> str:
        """The node id a connection introduced itself with (its connection id once it is gone)."""
        peer = self.peers.get(conn_id)
        return peer.node_id if peer is not None else conn_id

    def trusted(self, conn_id: str) -> bool:
        """Whether the verifier believes this connection's q (False once it is gone)."""
        peer = self.peers.get(conn_id)
        return peer is not None and peer.trusted

    def send(self, conn_id: str, msgs: list[Batchable]) -> None:
        peer = self.peers.get(conn_id)
        if peer is not None:
            peer.put(encode_many(msgs))

    def send_frontend(self, origin: str, msgs: list[Batchable]) -> None:
        frame = b""
        for peer in self.peers.values():
            if peer.role == "frontend" and peer.node_id == origin:
                frame = frame or encode_many(msgs)
                peer.put(frame)

    def fleet_status(self) -> FleetStatus:
        drafters = sorted(p.node_id for p in self.peers.values() if p.role == "drafter")
        share = self.intake.core.draft_share() if self.intake is not None else 1.0
        return FleetStatus(drafters=drafters, sessions=len(self.routes), target_model=self.welcome.target_model,
                           draft_share=share)

    def broadcast_fleet(self, status: FleetStatus | None = None) -> None:
        status = status or self.fleet_status()
        self.last_share = status.draft_share
        frame = encode(status)
        for peer in self.peers.values():
            if peer.role == "frontend":
                peer.put(frame)

    # --- HTTP layer ----------------------------------------------------------------------

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path == "/health":
            return connection.respond(HTTPStatus.OK, "ok\n")
        if request.path == "/metrics":
            body = self.metrics.render()
            headers = Headers([("Content-Type", "text/plain; version=0.0.4; charset=utf-8"),
                               ("Content-Length", str(len(body)))])
            return Response(HTTPStatus.OK.value, "OK", headers, body)
        if request.path == "/status":
            status = self.intake.core.status() if self.intake is not None else {"error": "starting"}
            body = json.dumps(status, indent=1).encode()
            headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return Response(HTTPStatus.OK.value, "OK", headers, body)
        if request.path == "/fleet":
            return self._fleet(connection, request)
        if request.path not in PATH_ROLES:
            return connection.respond(HTTPStatus.NOT_FOUND, "use /v1/drafter or /v1/frontend\n")
        given = request.headers.get("Authorization")
        if self.credentials.authenticate(given, PATH_ROLES[request.path]) is None:
            log.warning("refused unauthenticated peer", path=request.path)
            return connection.respond(HTTPStatus.UNAUTHORIZED,
                                      self.credentials.refusal(given, PATH_ROLES[request.path]) + "\n")
        return None

    def _fleet(self, connection: ServerConnection, request: Request) -> Response:
        given = request.headers.get("Authorization")
        if self.credentials.authenticate(given, "frontend") is None:
            return connection.respond(HTTPStatus.UNAUTHORIZED, self.credentials.refusal(given, "frontend") + "\n")
        body = json.dumps(fleet_view(self)).encode()
        headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return Response(HTTPStatus.OK.value, "OK", headers, body)

    # --- one connection --------------------------------------------------------------------

    async def handle(self, ws: ServerConnection) -> None:
        role = PATH_ROLES[ws.request.path if ws.request else ""]
        identity = self.credentials.authenticate(ws.request.headers.get("Authorization") if ws.request else None,
                                                 role)
        if identity is None:  # revoked between the HTTP upgrade and now
            return await self._refuse(ws, "unauthorized", self.credentials.refusal(None, role))
        hello = await self._handshake(ws, role)
        if hello is None:
            return
        problem = check_hello_identity(identity, hello.node_id)
        if problem:
            return await self._refuse(ws, "unauthorized", problem)
        trusted = identity.trusted if identity.trusted is not None else self.default_trust
        peer = Peer(f"{role}-{next(_conn_ids)}", role, hello.node_id, hello.model, ws, identity, trusted)
        self.peers[peer.conn_id] = peer
        log.info("peer connected", conn=peer.conn_id, node_id=peer.node_id, model=peer.model,
                 trusted=peer.trusted if role == "drafter" else None)
        peer.put(encode(self.welcome))
        writer = asyncio.create_task(self._write(ws, peer))
        if role == "drafter":
            self.metrics.drafter_connected(peer.node_id)
            self.broadcast_fleet()
        else:
            peer.put(encode(self.fleet_status()))
            if self.intake is not None:
                self.intake.frontend_up(peer.node_id)
        try:
            await self._read(ws, peer)
        finally:
            self.peers.pop(peer.conn_id, None)
            writer.cancel()
            if self.intake is not None and role == "drafter":
                self.intake.handle(peer.conn_id, "gone", None)
            elif self.intake is not None:
                linked = any(p.role == "frontend" and p.node_id == peer.node_id for p in self.peers.values())
                self.intake.frontend_gone(peer.conn_id, peer.node_id, linked)
            self.broadcast_fleet()
            log.info("peer disconnected", conn=peer.conn_id, node_id=peer.node_id)

    async def _handshake(self, ws: ServerConnection, role: str) -> Hello | None:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                raw = await ws.recv()
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
        if role == "drafter" and (problem := vocabulary_problem(hello, self.welcome)) is not None:
            return "bad_tokenizer", problem
        return None

    async def _refuse(self, ws: ServerConnection, code: str, message: str) -> None:
        log.warning("refused peer", code=code, reason=message)
        with contextlib.suppress(ConnectionClosed):
            await ws.send(encode(Refused(code=code, message=message)))  # type: ignore[arg-type]
            await ws.close(1008, code)

    async def _read(self, ws: ServerConnection, peer: Peer) -> None:
        assert self.intake is not None
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                received = time.perf_counter()
                try:
                    msg = decode(raw)
                except ProtocolError as exc:
                    peer.put(encode(ErrorFrame(code="bad_frame", message=str(exc))))
                    continue
                for item in unpack(msg):
                    self.intake.handle(peer.conn_id, peer.role, item, received)

    async def _write(self, ws: ServerConnection, peer: Peer) -> None:
        with contextlib.suppress(ConnectionClosed):
            while (frame := await peer.outbox.get()) is not None:
                await ws.send(frame)


async def start_server(hub: Hub, host: str, port: int, tls: ssl.SSLContext | None = None,
                       ping_interval_s: float = 10.0, ping_timeout_s: float = 20.0) -> Server:
    """Listen on ``host:port``: wss:// with ``tls`` (``shared.tls.server_context``), else ws://.
    A peer that answers no ping within ``ping_timeout_s`` is disconnected, as if it had closed:
    the closing handshake then waits at most as long again (never more than websockets' default
    10 s) for a peer that is gone."""
    # No per-message deflate: frames are small MessagePack, and compressing each one costs
    # both ends CPU on every round.
    server = await serve(hub.handle, host, port, process_request=hub.process_request, max_size=MAX_FRAME_BYTES,
                         ping_interval=ping_interval_s, ping_timeout=ping_timeout_s,
                         close_timeout=min(10.0, ping_timeout_s), compression=None, ssl=tls)
    return server


async def revocation_loop(hub: Hub) -> None:
    """Close every drafter connection whose per-drafter credential left the credentials file."""
    seen = hub.credentials.generation
    while True:
        await asyncio.sleep(REVOCATION_CHECK_S)
        hub.credentials.refresh()
        if hub.credentials.generation == seen:
            continue
        seen = hub.credentials.generation
        for peer in list(hub.peers.values()):
            if not hub.credentials.still_valid(peer.identity):
                log.warning("credential revoked; disconnecting the drafter", conn=peer.conn_id, node_id=peer.node_id)
                await _close_revoked(peer)


async def _close_revoked(peer: Peer) -> None:
    with contextlib.suppress(ConnectionClosed):
        await peer.ws.send(encode(Refused(code="unauthorized", message="this drafter's credential was revoked")))
    with contextlib.suppress(ConnectionClosed, TimeoutError):
        await asyncio.wait_for(peer.ws.close(1008, "credential revoked"), 2.0)


async def fleet_status_loop(hub: Hub) -> None:
    """Frontends also get a periodic FleetStatus, so their view never goes stale, and one as soon
    as the share of new requests the draft-length policy wants drafted for changes (SmartSpec
    turning speculation off or on; checked every DRAFT_SHARE_CHECK_S)."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(DRAFT_SHARE_CHECK_S)
        if hub.intake is not None:  # the same tick cancels orphans nobody adopted within the grace
            hub.intake.expire_orphans()
        now, status = time.monotonic(), hub.fleet_status()
        if status.draft_share != hub.last_share or now - last >= FLEET_STATUS_EVERY_S:
            hub.broadcast_fleet(status)
            last = now
