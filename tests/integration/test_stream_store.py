"""The stream store on each backend: records with a TTL, and Idempotency-Key claims that bind a
key to one request (a second claim gets the first request's id)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from services.coordinator.stream_store import (
    MemoryStreamStore,
    RedisStreamStore,
    SqliteStreamStore,
    StoreError,
    StreamRecord,
    StreamStore,
    key_hash,
    open_store,
)
from shared.protocol import OpenSession, SamplingParams

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture(params=["memory", "sqlite", pytest.param("redis", marks=pytest.mark.redis)])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StreamStore]:
    opened: StreamStore
    if request.param == "memory":
        opened = MemoryStreamStore()
    elif request.param == "sqlite":
        opened = SqliteStreamStore(tmp_path / "state" / "streams.sqlite3")
    else:
        opened = RedisStreamStore(request.getfixturevalue("redis_url"))
    yield opened
    await opened.close()


def record(rid: str, key: str = "Bearer k1") -> StreamRecord:
    opened = OpenSession(request_id=rid, prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=5), origin="c1",
                         speculative=False)
    return StreamRecord(request_id=rid, key=key_hash(key), kind="chat", model="target", created=1, opened=[opened],
                        owner="c1")


async def test_a_record_reads_back_until_its_ttl(store: StreamStore) -> None:
    rid = uuid.uuid4().hex
    assert await store.get(rid) is None
    await store.put(record(rid), 0.3)
    assert await store.get(rid) == record(rid)
    await asyncio.sleep(0.45)
    assert await store.get(rid) is None


async def test_an_idempotency_key_binds_to_its_first_request(store: StreamStore) -> None:
    key, idem = key_hash("Bearer k1"), uuid.uuid4().hex
    assert await store.claim(key, idem, "first", 5) is None
    assert await store.claim(key, idem, "second", 5) == "first"
    assert await store.claim(key_hash("Bearer k2"), idem, "other", 5) is None  # another key's: its own
    await store.unclaim(key, idem)
    assert await store.claim(key, idem, "third", 5) is None


async def test_the_sqlite_store_outlives_its_process(tmp_path: Path) -> None:
    path = tmp_path / "streams.sqlite3"
    first = open_store("", str(path))
    await first.put(record("r" * 32), 60)
    await first.close()
    again = open_store("", str(path))
    assert (await again.get("r" * 32)) == record("r" * 32)
    await again.close()


async def test_a_store_that_cannot_open_says_where() -> None:
    with pytest.raises(StoreError, match="/proc/no-such"):
        SqliteStreamStore("/proc/no-such/streams.sqlite3")
