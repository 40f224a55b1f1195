"""Test peers for the coordinator: a real loopback WebSocket "verifier" and a live server harness.

``FakeVerifier`` speaks the real frontend protocol (Hello -> Welcome, FleetStatus, TokenEvent,
Cancel, OpenSession, ErrorFrame, Batch) on a real socket, and plays drafter + verifier by taking
QueuedRequests from a queue (or target-only OpenSessions from the coordinator) and emitting
scripted TokenEvents: ``max_tokens`` tokens " w0", " w1", ... two per event, finish_reason
"length". Prompts whose text contains a marker change the script: ``HANG`` never answers,
``FAIL`` ends in an error event, ``REFUSE`` is refused at once as "invalid" (as a verifier
whose backend does not serve a field does), ``SLOW`` waits between events, ``GATE`` waits until
``fake.gate`` is set; for target-only sessions, ``BUSY`` is refused with ErrorFrame "busy" and
``BROKEN`` with another ErrorFrame code (both inside a Batch frame, as the real verifier sends).

``LiveCoordinator`` runs the coordinator under a real uvicorn server plus a FakeVerifier in a
background thread with its own event loop, so synchronous clients (openai, httpx, websockets)
can talk to it over loopback.

``in_process`` runs the coordinator app in the test's own event loop (lifespan included) with an
httpx ASGITransport client; ``RawHttp`` and ``RawWebSocket`` drive single requests through the
ASGI app by hand, so a test can make the client vanish at a moment of its choosing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from websockets.asyncio.server import Server, ServerConnection, serve

from services.coordinator.app import create_app
from services.coordinator.config import CoordinatorConfig
from services.coordinator.model_info import ModelInfo
from services.coordinator.state import CoordinatorState
from shared.config import from_flags
from shared.protocol import (
    PROTOCOL_VERSION,
    Batch,
    Cancel,
    ErrorFrame,
    FleetStatus,
    Hello,
    OpenSession,
    QueuedRequest,
    Refused,
    TokenEvent,
    Welcome,
    decode,
    encode,
)
from shared.queue import QueueError, RequestQueue
from shared.queue_memory import MemoryQueue

SLOW_DELAY_S = 0.05


def expected_text(n: int) -> str:
    return "".join(f" w{i}" for i in range(n))


class FakeVerifier:
    def __init__(
        self,
        queue: RequestQueue | None,
        tokenizer: Any,
        *,
        auth_token: str = "",
        fingerprint: str = "",
        drafters: tuple[str, ...] = ("fake-drafter",),
        refuse: str = "",
        max_model_len: int = 512,
        orphan_grace_s: float = 0.0,
    ) -> None:
        self.queue = queue
        self.orphan_grace_s = orphan_grace_s  # > 0: the coordinator records streams for a resume
        self.tokenizer = tokenizer
        self.auth_token = auth_token
        self.fingerprint = fingerprint
        self.drafters = list(drafters)
        self.refuse = refuse
        self.max_model_len = max_model_len
        self.frontends: dict[str, ServerConnection] = {}
        self.hellos: list[Hello] = []
        self.auth_headers: list[str | None] = []
        self.cancels: list[str] = []
        self.seen: list[QueuedRequest] = []
        self.opened: list[OpenSession] = []
        self.completed: list[str] = []
        self.gate = asyncio.Event()
        self._server: Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = next(iter(self._server.sockets)).getsockname()[1]
        return f"ws://127.0.0.1:{port}/v1/frontend"

    async def start(self) -> None:
        self._server = await serve(self._handler, "127.0.0.1", 0)
        if self.queue is not None:
            self._spawn(self._consume())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def drop_frontends(self) -> None:
        """Close every frontend connection (the coordinator should reconnect)."""
        for ws in list(self.frontends.values()):
            await ws.close()

    async def send_status(self, drafters: list[str], draft_share: float = 1.0) -> None:
        self.drafters = drafters
        for ws in list(self.frontends.values()):
            await ws.send(encode(FleetStatus(drafters=drafters, sessions=0, target_model="target",
                                             draft_share=draft_share)))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handler(self, ws: ServerConnection) -> None:
        self.auth_headers.append(ws.request.headers.get("Authorization") if ws.request else None)
        hello = decode(await ws.recv())
        assert isinstance(hello, Hello)
        self.hellos.append(hello)
        expected = f"Bearer {self.auth_token}" if self.auth_token else None
        if self.refuse or (expected and self.auth_headers[-1] != expected):
            await ws.send(encode(Refused(code="unauthorized", message=self.refuse or "bad token")))
            await ws.close(1008)
            return
        await ws.send(encode(Welcome(node_id="fake-verifier", protocol_version=PROTOCOL_VERSION,
                                     target_model="target", tokenizer_fingerprint=self.fingerprint,
                                     max_model_len=self.max_model_len, max_draft_tokens=8,
                                     orphan_grace_s=self.orphan_grace_s)))
        await ws.send(encode(FleetStatus(drafters=self.drafters, sessions=0, target_model="target")))
        self.frontends[hello.node_id] = ws
        try:
            async for raw in ws:
                msg = decode(raw)
                if isinstance(msg, Cancel):
                    self.cancels.append(msg.request_id)
                elif isinstance(msg, OpenSession):
                    self.opened.append(msg)
                    self._spawn(self._open(ws, msg))
        finally:
            if self.frontends.get(hello.node_id) is ws:
                del self.frontends[hello.node_id]

    async def _consume(self) -> None:
        assert self.queue is not None
        while True:
            try:
                deliveries = await self.queue.get("fake-drafter", 8, timeout_s=0.5)
            except QueueError:  # a queue link that is not up yet: retry, as a drafter does
                await asyncio.sleep(0.1)
                continue
            for delivery in deliveries:
                self.seen.append(delivery.request)
                self._spawn(self._generate(delivery.request, delivery.delivery_id))

    async def emit(self, origin: str, event: TokenEvent) -> None:
        ws = self.frontends.get(origin)
        if ws is not None:
            await ws.send(encode(event))

    async def _open(self, ws: ServerConnection, req: OpenSession) -> None:
        """A target-only session: refused when its prompt says BUSY or BROKEN, else generated."""
        prompt, rid = self.tokenizer.decode(req.prompt_ids), req.request_id
        if "BUSY" in prompt:
            err = ErrorFrame(code="busy", message="the verifier holds 2 sessions; retry later", request_id=rid)
        elif "BROKEN" in prompt:
            err = ErrorFrame(code="duplicate", message="request is already served", request_id=rid)
        else:
            await self._generate(req)
            return
        await ws.send(encode(Batch(items=[err])))

    async def _generate(self, req: QueuedRequest | OpenSession, delivery_id: str | None = None) -> None:
        prompt = self.tokenizer.decode(req.prompt_ids)
        rid, n = req.request_id, req.params.max_tokens
        if "GATE" in prompt:
            await self.gate.wait()
        if "REFUSE" in prompt:
            await self.emit(req.origin, TokenEvent(
                request_id=rid, origin=req.origin, token_ids=[], text="", finished=True, finish_reason="error",
                error="logprobs: not supported by the verifier's backend", error_code="invalid"))
        elif "HANG" not in prompt:
            delay = SLOW_DELAY_S if "SLOW" in prompt else 0.0
            for start in range(0, n, 2):
                if rid in self.cancels:
                    break
                await asyncio.sleep(delay)
                ids = list(range(10 + start, 10 + min(start + 2, n)))
                last = start + 2 >= n
                failed = last and "FAIL" in prompt
                await self.emit(req.origin, TokenEvent(
                    request_id=rid, origin=req.origin, token_ids=ids,
                    text="" if failed else "".join(f" w{i}" for i in range(start, start + len(ids))),
                    finished=last, finish_reason=("error" if failed else "length") if last else None,
                    prompt_tokens=len(req.prompt_ids), completion_tokens=min(start + 2, n),
                    drafted_tokens=2 * min(start + 2, n), accepted_tokens=min(start + 2, n),
                    error="boom: the fake verifier failed" if failed else "", seq=start // 2 + 1))
            else:
                self.completed.append(rid)
        if delivery_id is not None:
            assert self.queue is not None
            await self.queue.ack("fake-drafter", delivery_id)


class LiveCoordinator:
    """A coordinator on a real uvicorn server, with a FakeVerifier, in a background thread."""

    def __init__(self, model_dir: str, tokenizer: Any, **cfg: Any) -> None:
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.cfg_overrides = cfg
        self.port = 0
        self.fake: FakeVerifier | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="live-coordinator", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LiveCoordinator:
        self._thread.start()
        if not self._started.wait(30) or self._error is not None:
            raise RuntimeError(f"live coordinator did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    def call(self, coro: Any, timeout: float = 10) -> Any:
        """Run a coroutine on the server's loop (e.g. to poke the fake verifier)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._started.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        queue = MemoryQueue()
        self.fake = FakeVerifier(queue, self.tokenizer)
        await self.fake.start()
        cfg = from_flags(CoordinatorConfig, model=self.model_dir, verifier_url=self.fake.url, node_id="coord-test",
                                **self.cfg_overrides)
        app = create_app(cfg, queue=queue)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                                               access_log=False, lifespan="on"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                await task
                raise RuntimeError("uvicorn exited during start-up")
            await asyncio.sleep(0.02)
        self.port = server.servers[0].sockets[0].getsockname()[1]
        state = app.state.coordinator
        for _ in range(500):  # the link is up and the first FleetStatus has arrived
            if state.link.connected and state.link.drafters:
                break
            await asyncio.sleep(0.02)
        self._started.set()
        await self._stop.wait()
        server.should_exit = True
        await task
        await self.fake.stop()


# --- in-process: the app in the test's loop ----------------------------------------------------


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait (polling) until ``predicate`` holds; fail the test if it does not within ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@dataclass
class InProcess:
    app: FastAPI
    state: CoordinatorState
    fake: FakeVerifier
    queue: MemoryQueue
    http: httpx.AsyncClient

    @property
    def in_flight(self) -> int:
        return self.state.generator.admission.in_flight

    async def metric(self, name: str) -> float:
        """One sample of /metrics, e.g. 'specfleet_coordinator_requests_in_flight' (0.0 if absent)."""
        text = (await self.http.get("/metrics")).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split(" ")[1])
        return 0.0


@contextlib.asynccontextmanager
async def in_process(
    model: ModelInfo, *, consume: bool = True, max_depth: int = 1024, drafters: tuple[str, ...] = ("fake-drafter",),
    orphan_grace_s: float = 0.0, **cfg: Any,
) -> AsyncIterator[InProcess]:
    """The coordinator app (lifespan running) in this loop, against a FakeVerifier on loopback.
    ``consume=False``: nothing takes requests off the queue; ``orphan_grace_s`` > 0: streams are
    recorded for a resume; ``cfg``: CoordinatorConfig fields."""
    queue = MemoryQueue(max_depth=max_depth)
    fake = FakeVerifier(queue if consume else None, model.tokenizer, drafters=drafters, orphan_grace_s=orphan_grace_s)
    await fake.start()
    try:
        config = from_flags(CoordinatorConfig, model=model.root, verifier_url=fake.url, node_id="coord-inproc", **cfg)
        app = create_app(config, queue=queue, model=model)
        state: CoordinatorState = app.state.coordinator
        async with app.router.lifespan_context(app):
            await until(lambda: state.link.connected and len(state.link.drafters) == len(drafters))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://coordinator", timeout=30) as http:
                yield InProcess(app, state, fake, queue, http)
    finally:
        await fake.stop()


AsgiMessage = MutableMapping[str, Any]


def _scope(kind: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": kind, "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
            "scheme": "http" if kind == "http" else "ws", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "headers": headers, "client": ("127.0.0.1", 50000),
            "server": ("coordinator", 80), "subprotocols": []}


class RawHttp:
    """One POST driven through the ASGI app by hand, as uvicorn would (ASGI spec 2.3): after
    :meth:`disconnect`, ``receive`` says http.disconnect and sends go nowhere."""

    def __init__(self, app: FastAPI, path: str, body: dict[str, Any]) -> None:
        self._app = app
        self._path = path
        self._body = json.dumps(body).encode()
        self._body_sent = False
        self._gone = asyncio.Event()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.got_chunk = asyncio.Event()

    def disconnect(self) -> None:
        self._gone.set()

    async def run(self) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self._body)).encode())]
        await self._app(_scope("http", self._path, headers), self._receive, self._send)

    async def _receive(self) -> AsgiMessage:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: AsgiMessage) -> None:
        if self._gone.is_set():
            return
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message.get("body"):
            self.chunks.append(message["body"])
            self.got_chunk.set()


class RawWebSocket:
    """A ``/v1/stream`` client driven through the ASGI app by hand, in this loop."""

    def __init__(self, app: FastAPI, path: str = "/v1/stream",
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self._app = app
        self._path = path
        self._headers = headers or []
        self._to_app: asyncio.Queue[AsgiMessage] = asyncio.Queue()
        self._from_app: asyncio.Queue[AsgiMessage] = asyncio.Queue()
        self._gone = False
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> RawWebSocket:
        self._to_app.put_nowait({"type": "websocket.connect"})
        scope = _scope("websocket", self._path, self._headers)
        self._task = asyncio.create_task(self._app(scope, self._to_app.get, self._send))
        accepted = await asyncio.wait_for(self._from_app.get(), 10)
        assert accepted["type"] == "websocket.accept", accepted
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._gone:
            await self.disconnect()

    async def _send(self, message: AsgiMessage) -> None:
        if self._gone:
            raise OSError("the client disconnected")  # what uvicorn raises (ClientDisconnected)
        await self._from_app.put(message)

    async def send_frame(self, data: str | bytes) -> None:
        """Send one raw frame: text, or binary."""
        key = "text" if isinstance(data, str) else "bytes"
        await self._to_app.put({"type": "websocket.receive", key: data})

    async def send_json(self, obj: dict[str, Any]) -> None:
        await self._to_app.put({"type": "websocket.receive", "text": json.dumps(obj)})

    async def receive(self, timeout_s: float = 10) -> dict[str, Any]:
        """The next frame as JSON, or ``{"type": "close", "code": ...}`` when the server closed."""
        message = await asyncio.wait_for(self._from_app.get(), timeout_s)
        if message["type"] == "websocket.close":
            return {"type": "close", "code": message.get("code", 1000)}
        loaded: dict[str, Any] = json.loads(message["text"])
        return loaded

    async def run(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Send one request; its token frames and the frame that ended it (done or error)."""
        await self.send_json(body)
        tokens = []
        while (frame := await self.receive())["type"] == "token":
            tokens.append(frame)
        return tokens, frame

    async def disconnect(self) -> None:
        """The client goes away; wait for the server's session to end."""
        self._gone = True
        await self._to_app.put({"type": "websocket.disconnect", "code": 1001})
        assert self._task is not None
        with contextlib.suppress(OSError):
            await asyncio.wait_for(self._task, 10)
