"""What any coordinator needs to take over a client's stream: one record per resumable request.

A record says how the request was opened (one target-only ``OpenSession`` per choice), how its
response is shaped, whose API key made it (a SHA-256 of the ``Authorization`` header: only that
key may resume it), which coordinator relays it now, and, for a finished non-streamed request
with an ``Idempotency-Key``, its whole response body. The tokens themselves stay with the
verifier, which replays them to the coordinator that adopts the request.

Three stores, one interface:

* :class:`RedisStreamStore` (with ``--redis-url``): every coordinator of the fleet sees every
  record; keys ``specfleet:stream:<request id>`` and ``specfleet:idem:<API key's HMAC>:<the
  Idempotency-Key's SHA-256>``, each with a TTL;
* :class:`SqliteStreamStore` (``--stream-store PATH``): one file that outlives this coordinator
  (``specfleet up`` restarts it on the same port and the same file);
* :class:`MemoryStreamStore`: this process only (a client that lost its connection comes back).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sqlite3
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Protocol

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.log import get_logger
from shared.protocol import OpenSession
from shared.queue_redis import redact_url

log = get_logger("coordinator.stream_store")
PREFIX = "specfleet:"
SWEEP_EVERY_S = 1.0


class StreamRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str  # choice 0's: the stream's id
    key: str  # key_hash() of the Authorization header that made it
    kind: str  # "chat" or "completion"
    model: str
    created: int
    opened: list[OpenSession]  # per choice, in its target-only form
    owner: str  # the coordinator that relays it now
    stream: bool = True
    include_usage: bool = False
    continuous_usage: bool = False
    echo: str = ""
    result: bytes = b""  # a finished non-streamed request's JSON body
    fingerprint: str = ""  # of an idempotent request's body, which a retry must repeat


class StoreError(RuntimeError):
    """The store cannot be read or written (Redis down, a broken file)."""


def key_hash(authorization: str, secret: str = "") -> str:
    """Whose request it is, as stored: an HMAC of the Authorization header (keyed with the fleet's
    --auth-token, so the store's reader cannot test guesses of an API key against it)."""
    return hmac.new(secret.encode(), authorization.strip().encode(), hashlib.sha256).hexdigest()


def _idem(key: str, idempotency_key: str) -> str:
    return f"{key}:{hashlib.sha256(idempotency_key.encode()).hexdigest()}"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StreamRecord)


class StreamStore(Protocol):
    async def put(self, record: StreamRecord, ttl_s: float) -> None: ...

    async def get(self, request_id: str) -> StreamRecord | None: ...

    async def claim(self, key: str, idempotency_key: str, request_id: str, ttl_s: float) -> str | None:
        """Bind ``idempotency_key`` of ``key`` to ``request_id`` unless it is bound: the bound id, or None."""
        ...

    async def unclaim(self, key: str, idempotency_key: str) -> None: ...

    async def close(self) -> None: ...


class MemoryStreamStore:
    def __init__(self) -> None:
        self._records: dict[str, tuple[float, StreamRecord]] = {}
        self._claims: dict[str, tuple[float, str]] = {}
        self._swept = 0.0

    def _sweep(self) -> None:
        """Forget what expired (at most once a second; reads check expiry themselves)."""
        now = time.monotonic()
        if now - self._swept < SWEEP_EVERY_S:
            return
        self._swept = now
        for table in (self._records, self._claims):
            for k in [k for k, (until, _) in table.items() if until <= now]:
                del table[k]

    async def put(self, record: StreamRecord, ttl_s: float) -> None:
        self._sweep()
        self._records[record.request_id] = (time.monotonic() + ttl_s, record)

    async def get(self, request_id: str) -> StreamRecord | None:
        self._sweep()
        found = self._records.get(request_id)
        return found[1] if found and found[0] > time.monotonic() else None

    async def claim(self, key: str, idempotency_key: str, request_id: str, ttl_s: float) -> str | None:
        self._sweep()
        k, now = _idem(key, idempotency_key), time.monotonic()
        if k not in self._claims or self._claims[k][0] <= now:
            self._claims[k] = (now + ttl_s, request_id)
        bound = self._claims[k][1]
        return None if bound == request_id else bound

    async def unclaim(self, key: str, idempotency_key: str) -> None:
        self._claims.pop(_idem(key, idempotency_key), None)

    async def close(self) -> None:
        return None


class SqliteStreamStore:
    """Records in one SQLite file (WAL): each call is one short local transaction."""

    def __init__(self, path: str | Path) -> None:
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # survives this process's death; one fsync per checkpoint
            self._db.execute("CREATE TABLE IF NOT EXISTS streams (id TEXT PRIMARY KEY, data BLOB, until REAL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS claims (k TEXT PRIMARY KEY, id TEXT, until REAL)")
            for table in ("streams", "claims"):
                self._db.execute(f"CREATE INDEX IF NOT EXISTS {table}_until ON {table} (until)")
            os.chmod(path, 0o600)  # it holds prompts
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open the stream store {path}: {exc}") from None
        self._path = path
        self._swept = 0.0

    def _sweep(self) -> None:
        """Delete what expired, at most once a second (reads check expiry themselves)."""
        now = time.time()
        if now - self._swept >= SWEEP_EVERY_S:
            self._swept = now
            self._run("DELETE FROM streams WHERE until <= ?", (now,))
            self._run("DELETE FROM claims WHERE until <= ?", (now,))

    def _run(self, sql: str, args: tuple[object, ...]) -> list[tuple[object, ...]]:
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"stream store {self._path}: {exc}") from None

    async def put(self, record: StreamRecord, ttl_s: float) -> None:
        self._sweep()
        self._run("INSERT OR REPLACE INTO streams VALUES (?, ?, ?)",
                  (record.request_id, _encoder.encode(record), time.time() + ttl_s))

    async def get(self, request_id: str) -> StreamRecord | None:
        rows = self._run("SELECT data FROM streams WHERE id = ? AND until > ?", (request_id, time.time()))
        return _decoded(rows[0][0]) if rows else None  # type: ignore[arg-type]

    async def claim(self, key: str, idempotency_key: str, request_id: str, ttl_s: float) -> str | None:
        k, now = _idem(key, idempotency_key), time.time()
        self._sweep()
        self._run("DELETE FROM claims WHERE k = ? AND until <= ?", (k, now))
        self._run("INSERT OR IGNORE INTO claims VALUES (?, ?, ?)", (k, request_id, now + ttl_s))
        bound = str(self._run("SELECT id FROM claims WHERE k = ?", (k,))[0][0])
        return None if bound == request_id else bound

    async def unclaim(self, key: str, idempotency_key: str) -> None:
        self._run("DELETE FROM claims WHERE k = ?", (_idem(key, idempotency_key),))

    async def close(self) -> None:
        self._db.close()


class RedisStreamStore:
    def __init__(self, url: str) -> None:
        self._where = redact_url(url)
        self._redis = Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)

    async def put(self, record: StreamRecord, ttl_s: float) -> None:
        await self._call(self._redis.set(f"{PREFIX}stream:{record.request_id}", _encoder.encode(record),
                                         px=max(1, int(ttl_s * 1000))))

    async def get(self, request_id: str) -> StreamRecord | None:
        data = await self._call(self._redis.get(f"{PREFIX}stream:{request_id}"))
        return _decoded(data) if data else None

    async def claim(self, key: str, idempotency_key: str, request_id: str, ttl_s: float) -> str | None:
        k = f"{PREFIX}idem:{_idem(key, idempotency_key)}"
        for _ in range(3):  # the bound key may expire between SET NX and GET: then try again
            if await self._call(self._redis.set(k, request_id, nx=True, px=max(1, int(ttl_s * 1000)))):
                return None
            bound = await self._call(self._redis.get(k))
            if isinstance(bound, bytes):
                return None if bound.decode() == request_id else bound.decode()
        raise StoreError(f"the Idempotency-Key's binding in Redis at {self._where} keeps expiring; retry")

    async def unclaim(self, key: str, idempotency_key: str) -> None:
        await self._call(self._redis.delete(f"{PREFIX}idem:{_idem(key, idempotency_key)}"))

    async def _call(self, pending: Awaitable[Any]) -> Any:
        try:
            return await pending
        except (RedisError, OSError) as exc:
            raise StoreError(f"the stream store in Redis at {self._where}: {type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        await self._redis.aclose()


def _decoded(data: bytes) -> StreamRecord | None:
    """A stored record, or None when it cannot be read (written by an incompatible version)."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError included
        log.warning("unreadable stream record ignored", error=str(exc))
        return None


def open_store(redis_url: str, path: str) -> StreamStore:
    """``--stream-store`` PATH: SQLite there; else Redis with ``--redis-url``; else this process."""
    if path:
        return SqliteStreamStore(path)
    if redis_url:
        return RedisStreamStore(redis_url)
    return MemoryStreamStore()
