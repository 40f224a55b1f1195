"""One behavioural suite for every producer-side queue: MemoryQueue and RedisStreamQueue.

The same tests run against both, so the drafters cannot tell the transports apart. Redis
runs for real (tests/redis_fixture.py); each test gets its own stream.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from shared.protocol import Hello, QueuedRequest, SamplingParams, encode
from shared.queue import Delivery, QueueError, RequestQueue
from shared.queue_memory import TURN_GRACE_S, MemoryQueue
from shared.queue_redis import RedisStreamQueue

pytestmark = pytest.mark.asyncio


def request(i: int) -> QueuedRequest:
    return QueuedRequest(
        request_id=f"r{i}",
        prompt_ids=[1, 2, 3],
        params=SamplingParams(max_tokens=4),
        origin="coordinator-test",
        model="tiny",
        created_at=time.time(),
    )


@dataclass
class Backend:
    """Queues that share one backing store (one MemoryQueue, or one stream + group)."""

    name: str
    open: Callable[..., RequestQueue]
    raw: Redis | None = None
    stream: str = ""

    async def consumer_dies(self, queue: RequestQueue, consumer: str) -> RequestQueue:
        """Simulate a consumer vanishing without ACK; returns the queue a survivor should use.

        Memory: the coordinator's link calls release. Redis: nobody tells Redis (the process
        just stops, and with it its keep-alive), so a survivor with a short claim_idle_ms takes
        the entry over through XAUTOCLAIM.
        """
        if self.raw is None:
            await queue.release(consumer)
            return queue
        await queue.close()
        survivor = self.open(claim_idle_ms=100)
        await asyncio.sleep(0.15)
        return survivor


@pytest_asyncio.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "memory":
        shared = MemoryQueue()
        yield Backend("memory", lambda **_: shared)
        await shared.close()
        return
    url = request.getfixturevalue("redis_url")
    stream = f"test:{uuid.uuid4().hex}"
    raw = Redis.from_url(url)
    opened: list[RequestQueue] = []

    def open_redis(claim_idle_ms: int = 30000) -> RequestQueue:
        opened.append(RedisStreamQueue(url, stream=stream, group="drafters", claim_idle_ms=claim_idle_ms))
        return opened[-1]

    yield Backend("redis", open_redis, raw=raw, stream=stream)
    for q in opened:
        await q.close()
    await raw.delete(stream)
    await raw.aclose()


def ids(deliveries: list[Delivery]) -> list[str]:
    return [d.request.request_id for d in deliveries]


async def test_fifo_order(backend: Backend) -> None:
    q = backend.open()
    for i in range(5):
        await q.put(request(i))
    assert ids(await q.get("c1", max_items=2, timeout_s=1)) == ["r0", "r1"]
    assert ids(await q.get("c1", max_items=10, timeout_s=1)) == ["r2", "r3", "r4"]


async def test_get_timeout_returns_empty(backend: Backend) -> None:
    q = backend.open()
    start = time.monotonic()
    assert await q.get("c1", max_items=3, timeout_s=0.3) == []
    assert 0.25 <= time.monotonic() - start < 3
    assert await q.get("c1", timeout_s=0) == []


async def test_get_wakes_on_put(backend: Backend) -> None:
    q = backend.open()
    waiter = asyncio.create_task(q.get("c1", timeout_s=10))
    await asyncio.sleep(0.1)
    start = time.monotonic()
    await backend.open().put(request(7))
    assert ids(await waiter) == ["r7"]
    assert time.monotonic() - start < 3


async def test_ack_removes_for_good(backend: Backend) -> None:
    q = backend.open()
    await q.put(request(0))
    [d] = await q.get("c1", timeout_s=1)
    await q.ack("c1", d.delivery_id)
    await q.release("c1")
    other = backend.open(claim_idle_ms=50)
    await asyncio.sleep(0.1)
    assert await other.get("c2", timeout_s=0.2) == []
    assert await q.depth() == 0
    if backend.raw is not None:
        assert await backend.raw.xlen(backend.stream) == 0


async def test_ack_is_idempotent_and_ignores_unknown_ids(backend: Backend) -> None:
    q = backend.open()
    await q.put(request(0))
    await q.put(request(1))
    [d] = await q.get("c1", timeout_s=1)
    for delivery_id in (d.delivery_id, d.delivery_id, "999999-0", "424242", "not-an-id"):
        await q.ack("c1", delivery_id)
    assert ids(await q.get("c1", timeout_s=1)) == ["r1"]


async def test_unacked_request_redelivered_after_consumer_dies(backend: Backend) -> None:
    q = backend.open()
    await q.put(request(0))
    await q.put(request(1))
    [first] = await q.get("c1", timeout_s=1)
    survivor = await backend.consumer_dies(q, "c1")
    again = await survivor.get("c2", max_items=2, timeout_s=2)
    assert ids(again) == ["r0", "r1"]  # the re-delivered request is still first in line
    assert again[0].delivery_id == first.delivery_id


async def test_release_makes_unacked_requests_available_at_once(backend: Backend) -> None:
    q = backend.open()
    await q.put(request(0))
    await q.get("c1", timeout_s=1)
    await q.release("c1")
    other = backend.open()  # default claim_idle_ms=30 s: only release makes this immediate
    assert ids(await other.get("c2", timeout_s=2)) == ["r0"]


async def test_two_consumers_never_share_a_request(backend: Backend) -> None:
    producer = backend.open()
    for i in range(30):
        await producer.put(request(i))

    async def consume(name: str) -> list[str]:
        q = backend.open()
        got: list[str] = []
        while batch := await q.get(name, max_items=3, timeout_s=0.3):
            got += ids(batch)
            await asyncio.sleep(0.01)  # hold them a moment, as a drafter would
            for d in batch:
                await q.ack(name, d.delivery_id)
        return got

    a, b = await asyncio.gather(consume("a"), consume("b"))
    assert not set(a) & set(b)
    assert sorted(a + b) == sorted(f"r{i}" for i in range(30))
    assert len(a + b) == 30


async def test_depth_counts_undelivered(backend: Backend) -> None:
    q = backend.open()
    assert await q.depth() == 0
    for i in range(3):
        await q.put(request(i))
    assert await q.depth() == 3
    [d] = await q.get("c1", timeout_s=1)
    assert await q.depth() == 2
    await q.ack("c1", d.delivery_id)
    assert await q.depth() == 2
    await q.get("c1", max_items=5, timeout_s=1)
    assert await q.depth() == 0


@pytest.mark.redis
async def test_poison_entries_are_dropped(redis_url: str) -> None:
    stream = f"test:{uuid.uuid4().hex}"
    q = RedisStreamQueue(redis_url, stream=stream)
    raw = Redis.from_url(redis_url)
    try:
        await q.depth()  # creates the group
        await raw.xadd(stream, {"m": b"\xc1 not msgpack"})
        await raw.xadd(stream, {"m": encode(Hello(role="drafter", node_id="x", protocol_version=1))})
        await raw.xadd(stream, {"other": b"field"})
        await q.put(request(0))
        got = await q.get("c1", max_items=10, timeout_s=1)
        assert ids(got) == ["r0"]
        assert await raw.xlen(stream) == 1  # the three poison entries were deleted
        assert (await raw.xpending(stream, "drafters"))["pending"] == 1
    finally:
        await raw.delete(stream)
        await raw.aclose()
        await q.close()


@pytest.mark.redis
async def test_waiting_consumer_claims_idle_entries_without_new_traffic(redis_url: str) -> None:
    stream = f"test:{uuid.uuid4().hex}"
    dead = RedisStreamQueue(redis_url, stream=stream)
    alive = RedisStreamQueue(redis_url, stream=stream, claim_idle_ms=200)
    try:
        await dead.put(request(0))
        assert ids(await dead.get("dead", timeout_s=1)) == ["r0"]
        await dead.close()
        got = await asyncio.wait_for(alive.get("alive", timeout_s=None), timeout=5)
        assert ids(got) == ["r0"]
    finally:
        await dead.close()
        await alive.close()


@pytest.mark.redis
async def test_live_consumer_keeps_a_long_request(redis_url: str) -> None:
    """A request that takes longer than claim_idle_ms is not stolen while its consumer lives."""
    stream = f"test:{uuid.uuid4().hex}"
    busy = RedisStreamQueue(redis_url, stream=stream, claim_idle_ms=600)
    other = RedisStreamQueue(redis_url, stream=stream, claim_idle_ms=600)
    try:
        await busy.put(request(0))
        [d] = await busy.get("busy", timeout_s=1)
        assert await other.get("other", timeout_s=1.5) == []  # > 2 x claim_idle_ms: kept alive
        await busy.ack("busy", d.delivery_id)
        await busy.put(request(1))
        await busy.get("busy", timeout_s=1)
        await busy.close()  # dies holding r1: the keep-alive stops with it
        assert ids(await other.get("other", timeout_s=3)) == ["r1"]
    finally:
        await busy.close()
        await other.close()


async def test_memory_close_wakes_waiters_with_an_error() -> None:
    q = MemoryQueue()
    waiter = asyncio.create_task(q.get("c1"))
    await asyncio.sleep(0.05)
    await q.close()
    with pytest.raises(QueueError, match="closed"):
        await waiter
    with pytest.raises(QueueError, match="closed"):
        await q.put(request(0))


async def test_memory_cancelled_get_loses_nothing() -> None:
    q = MemoryQueue()
    waiter = asyncio.create_task(q.get("c1"))
    await asyncio.sleep(0.01)
    waiter.cancel()
    await q.put(request(0))
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert ids(await q.get("c2", timeout_s=1)) == ["r0"]


async def test_memory_ack_by_another_consumer_finishes_the_request() -> None:
    """A drafter whose link dropped may ACK late, after the request went to someone else."""
    q = MemoryQueue()
    await q.put(request(0))
    [d] = await q.get("old-link", timeout_s=1)
    await q.release("old-link")
    await q.ack("new-link", d.delivery_id)  # released and waiting: the late ACK removes it
    assert await q.depth() == 0
    assert q.in_flight() == 0


async def test_memory_ack_from_a_previous_coordinator_removes_nothing() -> None:
    """A drafter keeps an ACK while the coordinator is down and sends it to the restarted
    coordinator, whose queue is new: it must not match, and drop, a new request there (with ids
    that were bare counters, delivery "1" of the new queue was acknowledged and never served)."""
    before, after = MemoryQueue(), MemoryQueue()
    await before.put(request(0))
    [old] = await before.get("drafter-1", timeout_s=1)
    await after.put(request(1))
    await after.ack("drafter-1", old.delivery_id)
    assert ids(await after.get("drafter-2", timeout_s=1)) == ["r1"]


async def test_memory_room_is_what_the_consumers_said_less_what_they_took() -> None:
    q = MemoryQueue()
    assert q.room() is None  # nobody has pulled: nothing known
    for i in range(5):
        await q.put(request(i))
    await q.get("d1", max_items=1, timeout_s=1, room=2)
    assert q.room() == 1 and q.waiting_ids() == ["r1", "r2", "r3", "r4"]
    await q.get("d2", max_items=2, timeout_s=1, room=2)
    assert q.room() == 1 + 0 and q.waiting_ids() == ["r3", "r4"]
    await q.get("d1", max_items=1, timeout_s=1, room=1)  # its next pull says what is left
    assert q.room() == 0  # every consumer full: r4 has nobody
    await q.release("d2")  # gone: its room with it, its requests back in front
    assert q.room() == 0 and q.waiting_ids() == ["r1", "r2", "r4"]
    await q.get("d3", max_items=1, timeout_s=1)  # a consumer that does not say: unknown again
    assert q.room() is None


async def waiting(q: MemoryQueue, consumer: str, room: int) -> asyncio.Task[list[Delivery]]:
    task = asyncio.create_task(q.get(consumer, timeout_s=2, room=room))
    await asyncio.sleep(0.01)  # it waits now
    return task


@pytest.mark.parametrize(("site_1", "site_2", "second_goes_to"), [
    ("edge-box", "edge-box", "d1"),  # one machine: fill the drafter that serves already
    ("", "", "d2"),  # a machine each (no site said): the idle one
    ("box-a", "box-b", "d2"),
])
async def test_memory_turn_fills_one_drafter_of_a_machine_and_spreads_across_machines(
        site_1: str, site_2: str, second_goes_to: str) -> None:
    q = MemoryQueue()
    q.note_site("d1", site_1)
    q.note_site("d2", site_2)
    await q.put(request(0))
    assert ids(await q.get("d1", timeout_s=1, room=4)) == ["r0"]
    await asyncio.sleep(TURN_GRACE_S * 2)  # d1's turn as the one coming back lapsed
    # the one it should go to waits second, so that first come, first served would fail
    first, second = ("d2", "d1") if second_goes_to == "d1" else ("d1", "d2")
    tasks = {name: await waiting(q, name, 4 if name == "d2" else 3) for name in (first, second)}
    await q.put(request(1))
    done, pending = await asyncio.wait(tasks.values(), timeout=1, return_when=asyncio.FIRST_COMPLETED)
    assert done == {tasks[second_goes_to]} and ids(tasks[second_goes_to].result()) == ["r1"]
    for task in pending:
        task.cancel()


async def test_memory_turn_waits_for_a_drafter_on_its_way_back_and_not_longer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst on one machine: the drafter that took the first keeps its turn while its next pull
    travels (TURN_GRACE_S); one that does not come back loses it."""
    monkeypatch.setattr("shared.queue_memory.TURN_GRACE_S", 0.3)  # wide enough for a loaded machine
    q = MemoryQueue()
    for consumer in ("d1", "d2"):
        q.note_site(consumer, "edge-box")
    d2 = await waiting(q, "d2", 4)
    for i in range(3):
        await q.put(request(i))
    assert ids(await d2) == ["r0"]
    d1 = await waiting(q, "d1", 4)  # not d1's turn: d2 serves one and will pull again
    assert not d1.done()
    assert ids(await q.get("d2", timeout_s=1, room=3)) == ["r1"]  # d2 came back in time
    started = time.monotonic()
    assert ids(await asyncio.wait_for(d1, 1.5)) == ["r2"]  # d2 did not come back: d1 takes it
    assert 0.2 < time.monotonic() - started < 1.0  # when d2's turn lapsed


async def test_memory_turn_passes_a_full_drafter_by(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shared.queue_memory.TURN_GRACE_S", 5.0)  # waiting out a turn would show
    q = MemoryQueue()
    for consumer in ("d1", "d2"):
        q.note_site(consumer, "edge-box")
    await q.put(request(0))
    assert ids(await q.get("d1", timeout_s=1, room=1)) == ["r0"]  # d1 is full now
    d2 = await waiting(q, "d2", 4)
    await q.put(request(1))
    assert ids(await asyncio.wait_for(d2, 0.5)) == ["r1"]  # at once: d1 has no room to come back with


async def test_memory_a_finished_request_gives_its_drafter_the_turn_before_its_ack(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A full drafter whose request just finished gets the next one: the client's next request
    may come before the drafter's ACK, and must not go to the idle drafter of the same machine."""
    q = MemoryQueue()
    for consumer in ("d1", "d2"):
        q.note_site(consumer, "edge-box")
    for i in range(2):
        await q.put(request(i))
    first = await q.get("d1", max_items=2, timeout_s=1, room=2)
    assert ids(first) == ["r0", "r1"] and q.room() == 0
    await asyncio.sleep(TURN_GRACE_S * 2)
    d2 = await waiting(q, "d2", 4)
    monkeypatch.setattr("shared.queue_memory.TURN_GRACE_S", 5.0)  # d1's turn cannot lapse in this test
    q.note_finished("r0")  # its last token went out: d1 frees a room and comes back for more
    q.note_finished("r0")  # said twice (a replayed final event): counted once
    assert q.room() == 4 + 1
    await q.put(request(2))  # while d1 is not waiting: d2 must leave it for d1
    await asyncio.sleep(0.1)
    assert q.waiting_ids() == ["r2"] and not d2.done()
    assert ids(await q.get("d1", timeout_s=1, room=1)) == ["r2"] and not d2.done()
    await q.ack("d1", first[0].delivery_id)  # the ACK that follows does not free the room a second time
    assert q.room() == 4 + 0
    d2.cancel()


async def test_unreachable_redis_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    q = RedisStreamQueue(f"redis://:hunter2@127.0.0.1:{port}/0")
    expected = rf"cannot reach Redis at redis://:\*\*\*@127.0.0.1:{port}/0: .*is redis-server running\?"
    with pytest.raises(QueueError, match=expected) as err:
        await q.put(request(0))
    assert "hunter2" not in str(err.value)
    await q.close()
