"""The request queue on Redis Streams: many coordinators put, many drafters consume.

One stream entry per request, with a single field ``m`` holding ``shared.protocol.encode``
of the QueuedRequest. Drafters read through one consumer group, so each entry goes to one
drafter at a time and stays in the group's pending list until that drafter ACKs it.

Re-delivery: every ``get`` first runs XAUTOCLAIM for entries idle longer than
``claim_idle_ms`` - requests a dead drafter left pending - before reading new entries.
``release(consumer)`` cannot "unclaim" (Redis has no such command); it does the next best
thing and re-stamps the consumer's pending entries as long idle (XCLAIM ... IDLE), so the
very next XAUTOCLAIM by any drafter picks them up instead of waiting ``claim_idle_ms``.

Keep-alive: a live drafter may work on a request for longer than ``claim_idle_ms`` (long
generations). So that nobody claims it meanwhile, a background task re-claims this process's
unacknowledged entries to their own consumer every ``claim_idle_ms / 3`` (XCLAIM ... JUSTID
resets the idle time without counting a delivery). Only a dead process stops doing that.

Poison entries (not decodable, or not a QueuedRequest) are logged, ACKed and deleted: a bad
producer must never wedge every drafter that reads the stream.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.log import get_logger
from shared.protocol import ProtocolError, QueuedRequest, decode, encode
from shared.queue import Delivery, QueueError

log = get_logger("queue.redis")

T = TypeVar("T")
FIELD = b"m"
#: Idle time stamped on released entries: far beyond any sane claim_idle_ms (about 11 days).
RELEASED_IDLE_MS = 1_000_000_000
_ENTRY_ID = re.compile(r"^\d+-\d+$")
_PENDING_PAGE = 500


def redact_url(url: str) -> str:
    """The URL with any password replaced by ***, safe for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisStreamQueue:
    """RequestQueue on one Redis stream + consumer group. Connects lazily on first use."""

    def __init__(
        self,
        url: str,
        *,
        stream: str = "specfleet:requests",
        group: str = "drafters",
        claim_idle_ms: int = 30000,
        maxlen: int = 1_000_000,
    ) -> None:
        if claim_idle_ms < 1:
            raise ValueError(f"claim_idle_ms must be >= 1, got {claim_idle_ms}")
        self._where = redact_url(url)
        self._stream = stream
        self._group = group
        self._claim_idle_ms = claim_idle_ms
        self._maxlen = maxlen
        # Waits are cut into slices so that an idle drafter still runs XAUTOCLAIM regularly.
        self._slice_ms = max(50, min(2000, claim_idle_ms // 2))
        try:
            self._redis = Redis.from_url(url, socket_timeout=15.0, socket_connect_timeout=5.0)
        except ValueError as exc:
            raise QueueError(f"bad Redis URL {self._where}: {exc}") from None
        self._group_ready = False
        self._claim_cursor: bytes | str = "0-0"
        self._held: dict[str, set[str]] = {}  # consumer -> entry ids delivered here, not yet ACKed
        self._keepalive: asyncio.Task[None] | None = None
        self._keepalive_s = max(0.05, claim_idle_ms / 3000)

    async def put(self, request: QueuedRequest) -> None:
        data = encode(request)
        await self._run(lambda: self._redis.xadd(self._stream, {FIELD: data}, maxlen=self._maxlen))

    async def get(self, consumer: str, max_items: int = 1, timeout_s: float | None = None,
                  room: int = 0) -> list[Delivery]:
        """Idle entries of dead consumers first, then new ones; [] when ``timeout_s`` passes.
        ``room`` is not used: the coordinators do not see who reads the stream.

        If this call is cancelled while Redis is handing over new entries, they stay pending
        under ``consumer`` and come back through XAUTOCLAIM after ``claim_idle_ms``: delayed,
        never lost.
        """
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + max(0.0, timeout_s)
        while True:
            out = await self._claim_idle(consumer, max_items)
            if len(out) < max_items:
                block_ms: int | None = None  # no wait when idle entries already arrived
                if not out:
                    left_ms = self._slice_ms if deadline is None else int((deadline - loop.time()) * 1000)
                    block_ms = min(self._slice_ms, left_ms) if left_ms >= 1 else None
                out += await self._read_new(consumer, max_items - len(out), block_ms)
            if out:
                self._hold(consumer, out)
                return out
            if deadline is not None and loop.time() >= deadline:
                return out

    async def ack(self, consumer: str, delivery_id: str) -> None:
        """XACK + XDEL; idempotent, and an id that is not a stream entry id is ignored."""
        if not _ENTRY_ID.match(delivery_id):
            log.warning("ignoring ACK of a malformed entry id", consumer=consumer, delivery_id=delivery_id)
            return
        await self._run(lambda: self._ack_and_delete([delivery_id]))
        for held in self._held.values():
            held.discard(delivery_id)

    async def release(self, consumer: str) -> None:
        """Make the consumer's pending entries claimable now (see the module docstring)."""
        self._held.pop(consumer, None)
        ids: list[Any] = await self._run(lambda: self._pending_ids(consumer))
        if ids:
            await self._run(
                lambda: self._redis.xclaim(
                    self._stream, self._group, consumer, 0, ids, idle=RELEASED_IDLE_MS, justid=True
                )
            )
            log.info("released pending requests", consumer=consumer, count=len(ids))
        else:
            await self._run(lambda: self._redis.xgroup_delconsumer(self._stream, self._group, consumer))

    async def depth(self) -> int:
        """Entries not yet delivered to the group: its ``lag``, or XLEN minus pending."""
        groups: list[dict[str, Any]] = await self._run(lambda: self._redis.xinfo_groups(self._stream))
        for info in groups:
            if _text(info["name"]) == self._group:
                lag = info.get("lag")
                if isinstance(lag, int):
                    return lag
                length: int = await self._run(lambda: self._redis.xlen(self._stream))
                return max(0, length - int(info["pending"]))
        return 0

    async def close(self) -> None:
        """Stop the keep-alive (held entries then go idle and are claimed) and disconnect."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.wait([self._keepalive])
            self._keepalive = None
        self._held.clear()
        await self._redis.aclose()

    # --- internals ------------------------------------------------------------------------

    def _hold(self, consumer: str, deliveries: list[Delivery]) -> None:
        self._held.setdefault(consumer, set()).update(d.delivery_id for d in deliveries)
        if self._keepalive is None or self._keepalive.done():
            self._keepalive = asyncio.create_task(self._keep_alive(), name=f"queue-keepalive-{self._stream}")

    async def _keep_alive(self) -> None:
        """Re-claim held entries to their consumer until none are held (restarted by _hold)."""
        while any(self._held.values()):
            await asyncio.sleep(self._keepalive_s)
            for consumer, held in list(self._held.items()):
                try:
                    await self._refresh(consumer, held)
                except QueueError as exc:
                    log.warning("could not keep pending requests claimed", consumer=consumer, reason=str(exc))

    async def _refresh(self, consumer: str, held: set[str]) -> None:
        snapshot = set(held)
        owned = set(await self._run(lambda: self._pending_ids(consumer)))
        held -= snapshot - owned  # ACKed elsewhere, trimmed, or claimed by another consumer
        mine = sorted(snapshot & owned)
        if mine:
            await self._run(
                lambda: self._redis.xclaim(self._stream, self._group, consumer, 0, mine, justid=True)  # type: ignore[arg-type]
            )

    async def _claim_idle(self, consumer: str, count: int) -> list[Delivery]:
        reply: Any = await self._run(
            lambda: self._redis.xautoclaim(
                self._stream, self._group, consumer, self._claim_idle_ms, self._claim_cursor, count=count
            )
        )
        self._claim_cursor = reply[0]  # continue the scan next time; "0-0" means wrapped around
        entries = reply[1]
        if entries:
            log.info("claimed requests left idle by another consumer", consumer=consumer, count=len(entries))
        return await self._decode(entries)

    async def _read_new(self, consumer: str, count: int, block_ms: int | None) -> list[Delivery]:
        reply: Any = await self._run(
            lambda: self._redis.xreadgroup(self._group, consumer, {self._stream: ">"}, count=count, block=block_ms)
        )
        entries: list[tuple[bytes, dict[bytes, bytes] | None]] = []
        for _stream, stream_entries in reply or []:
            entries.extend(stream_entries)
        return await self._decode(entries)

    async def _decode(self, entries: list[tuple[bytes, dict[bytes, bytes] | None]]) -> list[Delivery]:
        out: list[Delivery] = []
        poison: list[str] = []
        for raw_id, fields in entries:
            entry_id = _text(raw_id)
            try:
                if not fields or FIELD not in fields:
                    raise ProtocolError(f"entry has no '{FIELD.decode()}' field")
                msg = decode(fields[FIELD])
                if not isinstance(msg, QueuedRequest):
                    raise ProtocolError(f"entry holds a {type(msg).__name__}, not a QueuedRequest")
            except ProtocolError as exc:
                log.warning("dropping poison queue entry", entry_id=entry_id, stream=self._stream, reason=str(exc))
                poison.append(entry_id)
                continue
            out.append(Delivery(entry_id, msg))
        if poison:
            await self._run(lambda: self._ack_and_delete(poison))
        return out

    async def _ack_and_delete(self, ids: list[str]) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(self._stream, self._group, *ids)
            pipe.xdel(self._stream, *ids)
            await pipe.execute()

    async def _pending_ids(self, consumer: str) -> list[str]:
        ids: list[str] = []
        low = "-"
        while True:
            page: Any = await self._redis.xpending_range(
                self._stream, self._group, low, "+", _PENDING_PAGE, consumername=consumer
            )
            ids.extend(_text(p["message_id"]) for p in page)
            if len(page) < _PENDING_PAGE:
                return ids
            low = "(" + ids[-1]

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            await self._redis.xgroup_create(self._stream, self._group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def _run(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis operation: group created first, errors turned into QueueError.

        A connection error is retried once on fresh connections: after Redis restarts, every
        connection pooled before it is dead, and the first caller should not pay for that with an
        error while Redis is up again. Each operation here is safe to repeat: a repeated XADD makes
        a second entry with the same request id, which the verifier declines as a duplicate."""
        try:
            try:
                return await self._once(op)
            except (RedisConnectionError, RedisTimeoutError, OSError):
                self._group_ready = False
                await self._redis.connection_pool.disconnect(inuse_connections=False)
                return await self._once(op)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            self._group_ready = False
            raise QueueError(f"cannot reach Redis at {self._where}: {exc}; is redis-server running?") from None
        except RedisError as exc:
            raise QueueError(
                f"Redis at {self._where} refused a queue operation on stream {self._stream!r}: {exc}"
            ) from None

    async def _once(self, op: Callable[[], Awaitable[T]]) -> T:
        await self._ensure_group()
        try:
            return await op()
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._group_ready = False  # the stream was deleted under us: recreate and retry once
            await self._ensure_group()
            return await op()
