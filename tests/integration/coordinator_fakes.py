"""Test peers for the coordinator: a real loopback WebSocket "verifier" and a live server harness.

``FakeVerifier`` speaks the real frontend protocol (Hello -> Welcome, FleetStatus, TokenEvent,
Cancel) on a real socket, and plays drafter + verifier by taking QueuedRequests from a queue
and emitting scripted TokenEvents: ``max_tokens`` tokens " w0", " w1", ... two per event,
finish_reason "length". Prompts whose text contains a marker change the script:
``HANG`` never answers, ``FAIL`` ends in an error event, ``SLOW`` waits between events.

``LiveCoordinator`` runs the coordinator under a real uvicorn server plus a FakeVerifier in a
background thread with its own event loop, so synchronous clients (openai, httpx, websockets)
can talk to it over loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import uvicorn
from websockets.asyncio.server import Server, ServerConnection, serve

from services.coordinator.app import create_app
from services.coordinator.config import CoordinatorConfig
from shared.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    FleetStatus,
    Hello,
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
    ) -> None:
        self.queue = queue
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
        self.completed: list[str] = []
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

    async def send_status(self, drafters: list[str]) -> None:
        self.drafters = drafters
        for ws in list(self.frontends.values()):
            await ws.send(encode(FleetStatus(drafters=drafters, sessions=0, target_model="target")))

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
                                     max_model_len=self.max_model_len, max_draft_tokens=8)))
        await ws.send(encode(FleetStatus(drafters=self.drafters, sessions=0, target_model="target")))
        self.frontends[hello.node_id] = ws
        try:
            async for raw in ws:
                msg = decode(raw)
                if isinstance(msg, Cancel):
                    self.cancels.append(msg.request_id)
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

    async def _generate(self, req: QueuedRequest, delivery_id: str) -> None:
        prompt = self.tokenizer.decode(req.prompt_ids)
        rid, n = req.request_id, req.params.max_tokens
        if "HANG" not in prompt:
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
                    error="boom: the fake verifier failed" if failed else ""))
            else:
                self.completed.append(rid)
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
        cfg = CoordinatorConfig(model=self.model_dir, verifier_url=self.fake.url, node_id="coord-test",
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
