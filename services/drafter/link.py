"""The drafter's connection to the verifier: handshake, sending, and routing replies to sessions.

One WebSocket carries every session of this drafter. Replies are routed by ``request_id`` into
per-session inboxes (asyncio queues), so sends and receives are decoupled from drafting compute
(StarSD §3). When the connection drops, every inbox receives :data:`LINK_LOST`; the serving
loop then drops its sessions and reconnects (the verifier finishes them target-only).

Refusals that no retry can fix (wrong tokenizer, protocol version, credentials) raise
:class:`LinkRefused` with ``fatal=True``, so the process can exit and tell the operator.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Final

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from shared.log import get_logger
from shared.protocol import (
    MAX_FRAME_BYTES,
    ErrorFrame,
    Hello,
    Message,
    ProtocolError,
    Refused,
    SessionOpened,
    Verdict,
    Welcome,
    decode,
    encode,
    unpack,
)
from shared.tls import ssl_kwargs

log = get_logger("drafter.link")

#: Refusal codes that mean "fix the configuration": reconnecting would only be refused again.
FATAL_REFUSALS: Final = frozenset({"bad_version", "bad_tokenizer", "unauthorized", "bad_hello"})


class LinkLostType:
    """Type of the sentinel put into every inbox when the connection drops."""

    def __repr__(self) -> str:
        return "LINK_LOST"


LINK_LOST: Final = LinkLostType()
Inbound = SessionOpened | Verdict | ErrorFrame | LinkLostType


class LinkDown(ConnectionError):
    """The verifier is unreachable or the connection dropped; reconnecting may help."""


class LinkRefused(RuntimeError):
    """The verifier refused this drafter at the handshake. ``fatal``: retrying cannot help."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"the verifier refused this drafter ({code}): {message}")
        self.code = code
        self.fatal = code in FATAL_REFUSALS


class VerifierLink:
    """One drafter's link to the verifier, reusable across reconnects."""

    def __init__(self, url: str, hello: Hello, auth_token: str = "", open_timeout_s: float = 10.0,
                 tls: ssl.SSLContext | None = None) -> None:
        """``url``: one verifier, or several replicas comma-separated: the link connects to one and,
        when it cannot reach it, tries the next (the coordinator fails its requests over too)."""
        self.urls = [u.strip() for u in url.split(",") if u.strip()] or [url]  # checked by url_list at start-up
        self.url = self.urls[0]
        self.tls = tls  # for wss://: the CA-pinned context (shared.tls.client_context); None: defaults
        self.hello = hello
        self.auth_token = auth_token
        self.open_timeout_s = open_timeout_s
        self.welcome: Welcome | None = None
        self._ws: ClientConnection | None = None
        self._inboxes: dict[str, asyncio.Queue[Inbound]] = {}

    @property
    def connected(self) -> bool:
        """True while a handshaken WebSocket to the verifier is open."""
        return self._ws is not None

    # --- connecting ----------------------------------------------------------------------

    async def connect(self) -> Welcome:
        """Open the WebSocket and handshake. Raises LinkDown or LinkRefused."""
        headers = {"Authorization": f"Bearer {self.auth_token}"} if self.auth_token else None
        try:
            ws = await connect(
                self.url, additional_headers=headers, max_size=MAX_FRAME_BYTES, compression=None,
                open_timeout=self.open_timeout_s, proxy=None, **ssl_kwargs(self.tls),
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status in (401, 403):
                raise LinkRefused("unauthorized", _auth_hint(status, bool(self.auth_token))) from None
            raise LinkDown(f"the verifier at {self.url} rejected the WebSocket upgrade with HTTP {status}") from None
        except InvalidURI as exc:
            raise LinkRefused("bad_hello", f"verifier_url {self.url!r} is not a ws:// or wss:// URL: {exc}") from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise LinkDown(f"cannot reach the verifier at {self.url}: {exc}") from None
        try:
            welcome = await self._handshake(ws)
        except BaseException:
            await ws.close()
            raise
        self._ws, self.welcome, self._inboxes = ws, welcome, {}
        return welcome

    async def _handshake(self, ws: ClientConnection) -> Welcome:
        try:
            await ws.send(encode(self.hello))
            async with asyncio.timeout(self.open_timeout_s):
                reply = decode(await ws.recv())
        except ConnectionClosed as exc:
            raise LinkDown(f"the verifier closed the connection during the handshake: {exc}") from None
        except TimeoutError:
            raise LinkDown(f"no handshake reply from the verifier within {self.open_timeout_s:g} s") from None
        except ProtocolError as exc:
            raise LinkDown(f"bad handshake reply from the verifier: {exc}") from None
        if isinstance(reply, Refused):
            raise LinkRefused(reply.code, reply.message)
        if not isinstance(reply, Welcome):
            raise LinkDown(f"expected Welcome or Refused from the verifier, got {type(reply).__name__}")
        return reply

    async def connect_with_retry(self, reconnect_s: float) -> Welcome:
        """Connect, retrying every ``reconnect_s`` while the verifier is down or full."""
        attempt = 0
        while True:
            attempt += 1
            try:
                welcome = await self.connect()
            except LinkRefused as exc:
                if exc.fatal:
                    raise
                log.warning("verifier refused the connection; retrying", code=exc.code, error=str(exc),
                            retry_in_s=reconnect_s, attempt=attempt)
            except LinkDown as exc:
                log.warning("verifier unreachable; retrying", error=str(exc), retry_in_s=reconnect_s,
                            attempt=attempt)
                self._next_replica()
            else:
                log.info("connected to the verifier", url=self.url, target_model=welcome.target_model,
                         max_draft_tokens=welcome.max_draft_tokens, attempt=attempt)
                return welcome
            await asyncio.sleep(reconnect_s)

    def _next_replica(self) -> None:
        """Try the next verifier replica on the next attempt (round robin; one URL: the same)."""
        self.url = self.urls[(self.urls.index(self.url) + 1) % len(self.urls)]

    # --- sessions' mailboxes ---------------------------------------------------------------

    def register(self, request_id: str) -> asyncio.Queue[Inbound]:
        """The inbox that receives every reply for ``request_id`` on the current connection."""
        inbox: asyncio.Queue[Inbound] = asyncio.Queue()
        if self._ws is None:
            inbox.put_nowait(LINK_LOST)
        self._inboxes[request_id] = inbox
        return inbox

    def unregister(self, request_id: str) -> None:
        self._inboxes.pop(request_id, None)

    # --- traffic -------------------------------------------------------------------------

    async def send(self, msg: Message) -> None:
        ws = self._ws
        if ws is None:
            raise LinkDown("not connected to the verifier")
        try:
            await ws.send(encode(msg))
        except ConnectionClosed as exc:
            raise LinkDown(f"the verifier link closed: {exc}") from None

    async def receive_loop(self) -> None:
        """Route frames to inboxes until the connection closes; then tell every session."""
        ws = self._ws
        if ws is None:
            return
        try:
            async for raw in ws:
                self._route(raw)
        except ConnectionClosed as exc:
            log.warning("verifier link dropped", error=str(exc))
        finally:
            self._lost()

    def _route(self, raw: bytes | str) -> None:
        try:
            msgs = unpack(decode(raw))
        except ProtocolError as exc:
            log.warning("dropped a bad frame from the verifier", error=str(exc))
            return
        for msg in msgs:
            self._route_one(msg)

    def _route_one(self, msg: Message) -> None:
        if isinstance(msg, SessionOpened | Verdict) or (isinstance(msg, ErrorFrame) and msg.request_id):
            inbox = self._inboxes.get(msg.request_id or "")
            if inbox is not None:
                inbox.put_nowait(msg)
            else:  # a session this drafter already dropped (e.g. after a cancel): nothing to do
                log.debug("frame for a session not served here", type=type(msg).__name__,
                          request_id=msg.request_id)
        elif isinstance(msg, ErrorFrame):
            log.warning("verifier reported an error", code=msg.code, message=msg.message)
        else:
            log.warning("unexpected frame from the verifier", type=type(msg).__name__)

    def _lost(self) -> None:
        self._ws = None
        for inbox in self._inboxes.values():
            inbox.put_nowait(LINK_LOST)

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()
        self._lost()


def _auth_hint(status: int, has_token: bool) -> str:
    if has_token:
        return (f"HTTP {status}: the verifier rejected our bearer token; set --auth-token "
                "(SPECFLEET_AUTH_TOKEN) to the verifier's token")
    return (f"HTTP {status}: the verifier requires a bearer token; set --auth-token "
            "(SPECFLEET_AUTH_TOKEN) to the verifier's token")
