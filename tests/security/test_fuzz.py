"""Fuzzing every WebSocket endpoint (10,000 frames each) and the REST endpoints (1,000+ bodies).

* the verifier's ``/v1/drafter`` and ``/v1/frontend`` (in-process verifier, real loopback socket),
  while a victim drafter runs a session that the fuzzer's frames name;
* the coordinator's ``/internal/queue`` (its router under uvicorn, real socket);
* the coordinator's ``/v1/stream`` (in-process through ASGI, plus a share over a real socket);
* ``/v1/chat/completions`` and ``/v1/completions`` (in-process, plus a share over a real socket).

Zero crashes: every server keeps serving (tasks alive, links up), answers bad frames with error
frames, every REST case is a 4xx in the OpenAI error shape, and afterwards each endpoint still
serves correct output (greedy output token-identical to the target alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import websockets
from websockets.sync.client import connect as ws_connect

from services.coordinator.model_info import ModelInfo
from services.verifier.config import VerifierConfig
from services.verifier.main import serve
from shared.config import from_flags
from shared.credentials import Credentials
from shared.models import load_model
from shared.protocol import (
    PROTOCOL_VERSION,
    Draft,
    ErrorFrame,
    Hello,
    OpenSession,
    QueuedRequest,
    SamplingParams,
    SessionOpened,
    Verdict,
    Welcome,
    decode,
    encode,
)
from shared.queue_link import QueueLinkClient
from shared.queue_memory import MemoryQueue
from tests.conftest import free_port, greedy_reference
from tests.integration.coordinator_fakes import LiveCoordinator, RawWebSocket, expected_text, in_process, until
from tests.integration.test_queue_link import serve as serve_queue
from tests.integration.test_verifier import TOKEN, Peer, Running, collect_text, connect, drive_session, noisy_oracle
from tests.security.fuzz import json_bodies, msgpack_frames, oversize

pytestmark = pytest.mark.faults
FRAMES = 10_000
QUIET_S = 2.0  # blast(): the answers have stopped after this long without one
BODIES = 1_000
REAL_SOCKET_SHARE = 300  # /v1/stream and REST cases also sent over a real uvicorn socket


@pytest_asyncio.fixture
async def verifier(tiny_models: dict[str, Path]) -> AsyncIterator[tuple[Running, asyncio.Task[None]]]:
    port = free_port()
    cfg = from_flags(VerifierConfig, port=port, model=str(tiny_models["target"]), auth_token=TOKEN, draft_len=3,
                         draft_timeout_s=1.5, log_level="warning",
                         resume_grace_s=0.0)  # scripted drafters, with no coordinator to send ResumeDone
    ready = asyncio.Event()
    task = asyncio.create_task(serve(cfg, ready))
    await asyncio.wait_for(ready.wait(), 60)
    yield Running(f"ws://127.0.0.1:{port}", load_model(tiny_models["target"])), task
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def blast(ws: Any, frames: Iterator[tuple[str, bytes | str]]) -> tuple[Counter[str], int]:
    """Send every frame while draining replies; (frames sent per category, replies received)."""
    sent: Counter[str] = Counter()
    replies = 0

    async def drain() -> None:
        nonlocal replies
        with contextlib.suppress(websockets.ConnectionClosed):
            async for _ in ws:
                replies += 1

    reader = asyncio.create_task(drain())
    for category, frame in frames:
        await ws.send(frame)
        sent[category] += 1
    # Until the answers stop coming: 2 s without a new one. The first ones may come only after the
    # last send (the sends need not give the server a turn), later still on a loaded machine.
    seen, quiet_since = replies, time.monotonic()
    deadline = quiet_since + 60
    while time.monotonic() - quiet_since < QUIET_S and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        if replies != seen:
            seen, quiet_since = replies, time.monotonic()
    assert ws.close_code is None, f"the server closed the link (code {ws.close_code}, {ws.close_reason})"
    reader.cancel()
    return sent, replies


async def refused_oversize(url: str, path: str, hello: Hello) -> int | None:
    """Send one frame past the limit on a fresh link; the close code it ends with."""
    ws = await websockets.connect(url + path, additional_headers={"Authorization": f"Bearer {TOKEN}"}, max_size=None)
    try:
        await ws.send(encode(hello))
        await ws.recv()
        with contextlib.suppress(websockets.ConnectionClosed):
            await ws.send(oversize())
            while True:
                await asyncio.wait_for(ws.recv(), 10)
        return ws.close_code
    finally:
        # the server cut the link mid-send; the client's own close may then fail inside websockets
        with contextlib.suppress(Exception):
            await ws.close()


def no_crash_logged(caplog: pytest.LogCaptureFixture) -> None:
    crashes = [r for r in caplog.records if r.exc_info or "unhandled" in r.getMessage()]
    assert not crashes, [r.getMessage() for r in crashes]


async def drive_rounds(peer: Peer, rid: str, prompt: list[int], opened: SessionOpened, propose: Any) -> list[int]:
    """Play the drafter of an opened session to its end; the committed tokens."""
    committed: list[int] = []
    rnd, budget = 0, opened.draft_budget
    while True:
        await peer.send(Draft(request_id=rid, round=rnd, token_ids=propose(prompt + committed, budget)))
        verdict = await peer.recv(Verdict, rid=rid)
        committed += verdict.token_ids
        if verdict.finished:
            return committed
        rnd, budget = rnd + 1, verdict.draft_budget


@pytest.mark.asyncio
async def test_fuzz_verifier_drafter_and_frontend_paths(verifier: tuple[Running, asyncio.Task[None]],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    running, task = verifier
    url, fp = running.url, running.target.fingerprint
    prompt = [3, 110, 111, 112]
    ref = greedy_reference(running.target.model, prompt, 64, running.target.eos_ids)
    long = SamplingParams(temperature=0.0, max_tokens=64)
    async with (connect(url, "frontend") as fe, connect(url, "drafter", fp, node_id="victim") as victim,
                connect(url, "drafter", fp, node_id="fuzz-drafter") as fuzz_d,
                connect(url, "frontend", node_id="fuzz-frontend") as fuzz_f):
        for peer in (victim, fuzz_d, fuzz_f):
            await peer.recv(Welcome)
        fuzz_d._reader.cancel()  # blast() reads these links itself
        fuzz_f._reader.cancel()
        await victim.send(OpenSession(request_id="victim-s", prompt_ids=prompt, params=long, origin="test-frontend"))
        opened = await victim.recv(SessionOpened, rid="victim-s")
        session = asyncio.create_task(drive_rounds(victim, "victim-s", prompt, opened, noisy_oracle(ref, 4, 9)))
        sent_d, replies_d = await blast(fuzz_d.ws, msgpack_frames(1, FRAMES, "victim-s", fp))
        sent_f, replies_f = await blast(fuzz_f.ws, msgpack_frames(2, FRAMES, "victim-s"))
        assert await session == ref, "the victim's session was disturbed"
        assert (await collect_text(fe, "victim-s"))[0] == ref
    assert sum(sent_d.values()) == FRAMES and sum(sent_f.values()) == FRAMES
    assert replies_d >= FRAMES * 0.8 and replies_f >= FRAMES * 0.8  # bad frames are answered, not dropped
    for path, role in (("/v1/drafter", "drafter"), ("/v1/frontend", "frontend")):
        hello = Hello(role=role, node_id="big", protocol_version=PROTOCOL_VERSION,  # type: ignore[arg-type]
                      tokenizer_fingerprint=fp if role == "drafter" else "")
        assert await refused_oversize(url, path, hello) == 1009  # message too big
    assert not task.done(), "the verifier stopped"
    # still serves exact output (to a coordinator that is linked: the fuzzed one left, and a gone
    # coordinator's requests are dropped)
    async with connect(url, "drafter", fp, node_id="after") as peer, connect(url, "frontend") as fe:
        await peer.recv(Welcome)
        await fe.recv(Welcome)
        committed, _ = await drive_session(peer, "after-fuzz", prompt, long, noisy_oracle(ref, 4, 10))
        assert committed == ref
    no_crash_logged(caplog)
    print(f"\nfuzz /v1/drafter: {dict(sent_d)}; /v1/frontend: {dict(sent_f)}")


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["shared-token", "per-drafter"])
async def test_fuzz_queue_link(mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    queue = MemoryQueue()
    auth: Credentials | str = TOKEN
    if mode == "per-drafter":  # every drafter below presents this token and names its identity
        creds = tmp_path / "credentials.json"
        creds.write_text(json.dumps({"drafters": [{"id": n, "token": TOKEN} for n in ("fuzz",)]}))
        auth = Credentials("", str(creds))
    async with serve_queue(queue, auth) as url:  # type: ignore[arg-type]
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with websockets.connect(url, additional_headers=headers) as ws:
            await ws.send(encode(Hello(role="drafter", node_id="fuzz", protocol_version=PROTOCOL_VERSION)))
            assert isinstance(decode(await ws.recv()), Welcome)
            sent, replies = await blast(ws, msgpack_frames(3, FRAMES, "victim"))
        assert sum(sent.values()) == FRAMES and replies >= FRAMES * 0.5
        async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
            await ws.send(encode(Hello(role="drafter", node_id="fuzz", protocol_version=PROTOCOL_VERSION)))
            await ws.recv()
            await ws.send(oversize())
            reply = decode(await asyncio.wait_for(ws.recv(), 10))
            assert isinstance(reply, ErrorFrame) and reply.code == "bad_frame" and "exceeds" in reply.message
        client = QueueLinkClient(url, TOKEN)  # afterwards the link still serves requests exactly once
        await queue.put(QueuedRequest(request_id="after", prompt_ids=[5], params=SamplingParams(), origin="c",
                                      model="m", created_at=time.time()))
        got = await client.get("fuzz", 1, 5.0)
        assert [d.request.request_id for d in got] == ["after"]
        await client.ack("fuzz", got[0].delivery_id)
        await until(lambda: queue.in_flight() == 0)
        await client.close()
        assert await queue.depth() == 0
    await queue.close()
    no_crash_logged(caplog)
    print(f"\nfuzz /internal/queue ({mode}): {dict(sent)}")


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> ModelInfo:
    return ModelInfo.load(str(tiny_models["target"]))


def ws_frames(seed: int, n: int) -> Iterator[tuple[str, bytes | str]]:
    """Frames for /v1/stream: JSON-ish text (the endpoint's format) and binary MessagePack."""
    bodies = json_bodies(seed, n // 2)
    frames = msgpack_frames(seed + 1, n - n // 2, "victim")
    for (cat_a, body), (cat_b, frame) in zip(bodies, frames, strict=False):
        text = body.decode(errors="replace")
        yield f"json_{cat_a}", text if cat_a != "not_an_object" else json.dumps({"kind": "chat", "x": text})
        yield f"msgpack_{cat_b}", frame


def assert_openai_error(status: int, body: Any, case: str) -> None:
    assert 400 <= status < 500, f"{case}: HTTP {status} {body!r:.300}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], f"{case}: {body!r:.300}"


@pytest.mark.asyncio
async def test_fuzz_stream_and_rest_in_process(model: ModelInfo, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with in_process(model) as h:
        sent: Counter[str] = Counter()
        for category, frame in ws_frames(4, FRAMES):
            async with RawWebSocket(h.app) as ws:
                await ws.send_frame(frame)
                reply = await ws.receive()
                assert reply["type"] == "error" and reply["error"]["type"] != "internal_error", (category, reply)
                assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
                assert (await ws.receive()) == {"type": "close", "code": 1008}, category  # 1008: a 4xx
                sent[category] += 1
        assert sum(sent.values()) == FRAMES
        rest: Counter[str] = Counter()
        for i, (category, body) in enumerate(json_bodies(5, BODIES)):
            resp = await h.http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
            assert_openai_error(resp.status_code, resp.json(), f"chat {category} {body[:80]!r}")
            rest[f"chat_{category}"] += 1
            if category != "wrong_types" and i % 5 == 0:
                resp = await h.http.post("/v1/completions", content=body)
                assert_openai_error(resp.status_code, resp.json(), f"completion {category} {body[:80]!r}")
                rest[f"completion_{category}"] += 1
        assert sum(rest.values()) >= BODIES
        async with RawWebSocket(h.app) as ws:  # still serving correct output
            tokens, done = await ws.run({"kind": "completion", "prompt": "fine", "max_tokens": 3})
            assert done["type"] == "done" and "".join(t["text"] for t in tokens) == expected_text(3)
        ok = await h.http.post("/v1/completions", json={"prompt": "fine", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected_text(4)
        no_crash_logged(caplog)  # checked before teardown, whose cancelled verifier link closes with 1011
    print(f"\nfuzz /v1/stream: {dict(sent)}; REST: {sum(rest.values())} bodies {dict(rest)}")


def test_fuzz_stream_and_rest_over_a_real_socket(model: ModelInfo) -> None:
    live = LiveCoordinator(model.root, model.tokenizer).start()
    try:
        for category, frame in ws_frames(6, REAL_SOCKET_SHARE):
            with ws_connect(live.base_url.replace("http://", "ws://") + "/v1/stream") as ws:
                ws.send(frame)
                reply = json.loads(ws.recv(timeout=10))
                assert reply["type"] == "error", (category, reply)
        with httpx.Client(base_url=live.base_url, timeout=10) as http:
            for category, body in json_bodies(7, REAL_SOCKET_SHARE):
                resp = http.post("/v1/chat/completions", content=body)
                assert_openai_error(resp.status_code, resp.json(), f"chat {category} {body[:80]!r}")
            ok = http.post("/v1/completions", json={"prompt": "fine", "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected_text(4)
    finally:
        live.stop()
