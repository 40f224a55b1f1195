"""QueueLinkClient against the real ``/internal/queue`` router, served by uvicorn on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
import uvicorn
from fastapi import FastAPI
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from services.coordinator.queue_link import make_queue_router
from shared.protocol import (
    PROTOCOL_VERSION,
    ErrorFrame,
    Hello,
    QueueDelivery,
    QueuedRequest,
    QueuePull,
    Refused,
    SamplingParams,
    Welcome,
    decode,
    encode,
)
from shared.queue import Delivery, QueueError
from shared.queue_link import QueueLinkClient
from shared.queue_memory import MemoryQueue

pytestmark = pytest.mark.asyncio
TOKEN = "s3cret"


def request(i: int) -> QueuedRequest:
    return QueuedRequest(
        request_id=f"r{i}",
        prompt_ids=[5, 6],
        params=SamplingParams(),
        origin="coord",
        model="tiny",
        created_at=time.time(),
    )


def ids(deliveries: list[Delivery]) -> list[str]:
    return [d.request.request_id for d in deliveries]


@contextlib.asynccontextmanager
async def serve(queue: MemoryQueue, token: str) -> AsyncIterator[str]:
    """Run the router under uvicorn on a free loopback port; yields the link URL."""
    app = FastAPI()
    app.include_router(make_queue_router(queue, token))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), "uvicorn failed to start"
            await asyncio.sleep(0.01)
        yield f"ws://127.0.0.1:{sock.getsockname()[1]}/internal/queue"
    finally:
        server.should_exit = True
        await task
        sock.close()


@pytest_asyncio.fixture
async def link() -> AsyncIterator[tuple[MemoryQueue, str]]:
    queue = MemoryQueue()
    async with serve(queue, TOKEN) as url:
        yield queue, url
    await queue.close()


async def eventually(check: Callable[[], bool], timeout_s: float = 3.0) -> None:
    """Poll until ``check()`` is true (ACKs and releases travel asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def drop(client: QueueLinkClient) -> None:
    """Cut the client's TCP connection as a network failure or a crash would."""
    ws = client._ws
    assert ws is not None
    ws.transport.abort()


async def test_get_and_ack_round_trip(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    client = QueueLinkClient(url, TOKEN)
    sent = request(0)
    await queue.put(sent)
    [d] = await client.get("drafter-a", timeout_s=5)
    assert d.request == sent
    assert queue.in_flight() == 1
    await client.ack("drafter-a", d.delivery_id)
    await eventually(lambda: queue.in_flight() == 0)
    assert await queue.depth() == 0
    await client.close()


async def test_fifo_and_max_items(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    client = QueueLinkClient(url, TOKEN)
    for i in range(5):
        await queue.put(request(i))
    got: list[str] = []
    while len(got) < 5:
        batch = await client.get("drafter-a", max_items=3, timeout_s=5)
        assert 1 <= len(batch) <= 3
        got += ids(batch)
    assert got == [f"r{i}" for i in range(5)]
    await client.close()


async def test_a_pull_says_the_drafters_room(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    client = QueueLinkClient(url, TOKEN)
    for i in range(3):
        await queue.put(request(i))
    await client.get("drafter-a", timeout_s=5, room=2)
    await eventually(lambda: queue.room() == 1)  # said 2, took 1
    await client.get("drafter-a", timeout_s=5, room=1)
    await eventually(lambda: queue.room() == 0 and queue.waiting_ids() == ["r2"])
    await client.close()
    await eventually(lambda: queue.room() is None)  # its link closed: released, nobody left
    assert queue.waiting_ids() == ["r0", "r1", "r2"]


async def test_drafters_of_one_site_fill_one_before_the_next(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    a, b = QueueLinkClient(url, TOKEN, site="edge-box"), QueueLinkClient(url, TOKEN, site="edge-box")
    await queue.put(request(0))
    assert ids(await a.get("drafter-a", timeout_s=5, room=4)) == ["r0"]
    assert await b.get("drafter-b", timeout_s=0.2, room=4) == []  # b's pull waits first: its link kept it
    await eventually(lambda: queue.room() == 3 + 4)
    pulls = [asyncio.create_task(c.get(name, timeout_s=5, room=r)) for c, name, r in ((b, "drafter-b", 4),
                                                                                     (a, "drafter-a", 3))]
    await asyncio.sleep(0.3)  # a's pull arrives too (and a's turn as the one coming back lapses)
    await queue.put(request(1))
    done, pending = await asyncio.wait(pulls, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    assert done == {pulls[1]} and ids(pulls[1].result()) == ["r1"]  # a, which serves already
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await a.close()
    await b.close()


async def test_room_that_grows_while_a_pull_waits_is_said_at_the_next_poll(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    client = QueueLinkClient(url, TOKEN)
    assert await client.get("drafter-a", timeout_s=0.2, room=1) == []  # nothing queued: the pull waits
    await eventually(lambda: queue.room() == 1)
    assert await client.get("drafter-a", timeout_s=0.2, room=3) == []  # sessions ended meanwhile: QueueRoom
    await eventually(lambda: queue.room() == 3)
    await queue.put(request(0))  # the waiting pull takes it
    await eventually(lambda: queue.room() == 2)
    assert ids(await client.get("drafter-a", timeout_s=5, room=3)) == ["r0"]
    await client.close()


@pytest.mark.parametrize("token", ["", "wrong"])
async def test_wrong_token_is_refused(link: tuple[MemoryQueue, str], token: str) -> None:
    _, url = link
    client = QueueLinkClient(url, token)
    with pytest.raises(QueueError, match=r"refused the queue link \(unauthorized\).*auth_token"):
        await client.get("drafter-a", timeout_s=5)
    await client.close()


async def test_refusal_closes_with_policy_violation(link: tuple[MemoryQueue, str]) -> None:
    _, url = link
    async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(encode(Hello(role="drafter", node_id="old", protocol_version=PROTOCOL_VERSION + 1)))
        refused = decode(await ws.recv())
        assert isinstance(refused, Refused) and refused.code == "bad_version"
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        assert ws.close_code == 1008


async def test_timed_out_get_keeps_its_pull_and_loses_nothing(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    client = QueueLinkClient(url, TOKEN)
    assert await client.get("drafter-a", timeout_s=0.2) == []
    await queue.put(request(0))
    await eventually(lambda: queue.in_flight() == 1)  # the outstanding pull took it
    assert ids(await client.get("drafter-a", timeout_s=2)) == ["r0"]
    assert queue.in_flight() == 1 and await queue.depth() == 0
    await client.close()


async def test_request_redelivered_after_link_drops_without_ack(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    a, b = QueueLinkClient(url, TOKEN), QueueLinkClient(url, TOKEN)
    await queue.put(request(0))
    [first] = await a.get("drafter-a", timeout_s=5)
    drop(a)
    [again] = await b.get("drafter-b", timeout_s=5)
    assert again.delivery_id == first.delivery_id and again.request.request_id == "r0"
    await a.close()
    await b.close()


async def test_late_ack_after_reconnect_prevents_a_duplicate(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    a, b = QueueLinkClient(url, TOKEN), QueueLinkClient(url, TOKEN)
    await queue.put(request(0))
    [d] = await a.get("drafter-a", timeout_s=5)
    drop(a)
    await eventually(lambda: queue.in_flight() == 0)  # the server released it
    # The request still runs here; a fresh get reconnects, and the re-delivered request is
    # not handed out a second time.
    assert await a.get("drafter-a", timeout_s=0.3) == []
    await a.ack("drafter-a", d.delivery_id)
    await eventually(lambda: queue.in_flight() == 0)
    assert await queue.depth() == 0
    assert await b.get("drafter-b", timeout_s=0.2) == []
    await a.close()
    await b.close()


async def test_get_raises_when_the_link_drops_while_waiting(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    client = QueueLinkClient(url, TOKEN)
    waiter = asyncio.create_task(client.get("drafter-a", timeout_s=5))
    await eventually(lambda: client._ws is not None)
    await asyncio.sleep(0.05)
    drop(client)
    with pytest.raises(QueueError, match="dropped"):
        await waiter
    await queue.put(request(0))  # the next call reconnects
    assert ids(await client.get("drafter-a", timeout_s=5)) == ["r0"]
    await client.close()


async def test_two_links_never_share_a_request(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    for i in range(12):
        await queue.put(request(i))

    async def consume(name: str) -> list[str]:
        client = QueueLinkClient(url, TOKEN)
        got: list[str] = []
        while batch := await client.get(name, max_items=2, timeout_s=0.3):
            got += ids(batch)
            for d in batch:
                await client.ack(name, d.delivery_id)
        await client.close()
        return got

    a, b = await asyncio.gather(consume("a"), consume("b"))
    assert not set(a) & set(b)
    assert sorted(a + b) == sorted(f"r{i}" for i in range(12))


async def test_malformed_frames_get_an_error_and_the_link_stays_up(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    async with connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(encode(Hello(role="drafter", node_id="raw", protocol_version=PROTOCOL_VERSION)))
        assert isinstance(decode(await ws.recv()), Welcome)
        welcome = Welcome(
            node_id="x",
            protocol_version=1,
            target_model="",
            tokenizer_fingerprint="",
            max_model_len=0,
            max_draft_tokens=0,
        )
        for bad, code in ((b"\xc1junk", "bad_frame"), ("text", "bad_frame"), (encode(welcome), "unexpected_frame")):
            await ws.send(bad)
            reply = decode(await ws.recv())
            assert isinstance(reply, ErrorFrame) and reply.code == code
        await queue.put(request(0))
        await ws.send(encode(QueuePull(max_items=4)))
        delivery = decode(await ws.recv())
        assert isinstance(delivery, QueueDelivery) and delivery.request.request_id == "r0"


async def test_queue_closed_ends_the_link_with_a_clear_error(link: tuple[MemoryQueue, str]) -> None:
    queue, url = link
    client = QueueLinkClient(url, TOKEN)
    waiter = asyncio.create_task(client.get("drafter-a", timeout_s=5))
    await asyncio.sleep(0.1)
    await queue.close()
    with pytest.raises(QueueError, match="dropped"):
        await waiter
    await client.close()


async def test_put_is_refused() -> None:
    client = QueueLinkClient("ws://127.0.0.1:1/internal/queue")
    with pytest.raises(QueueError, match="producers need"):
        await client.put(request(0))


async def test_unreachable_coordinator_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = QueueLinkClient(f"ws://127.0.0.1:{port}/internal/queue")
    with pytest.raises(QueueError, match=r"cannot reach the coordinator.s queue link.*is the coordinator running"):
        await client.get("drafter-a", timeout_s=5)
    await client.close()


async def test_wrong_path_is_a_clear_error(link: tuple[MemoryQueue, str]) -> None:
    _, url = link
    client = QueueLinkClient(url.replace("/internal/queue", "/nope"), TOKEN)
    with pytest.raises(QueueError, match=r"HTTP 403.*/internal/queue"):
        await client.get("drafter-a", timeout_s=5)
    await client.close()
