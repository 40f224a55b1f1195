"""Resumable streams: record each request, and take over one that another connection started.

A streamed request (and one sent with an ``Idempotency-Key``) is recorded in the stream store
(``stream_store.py``) before its first chunk goes out. Its client can then come back, to this
coordinator or any other of the fleet, with the same API key:

* SSE: the same POST with ``Last-Event-ID: <the id: of the last event received>``;
* WebSocket ``/v1/stream``: ``{"type": "resume", "request_id": ..., "index": <last index>}``;
* a non-streamed request: the same POST with the same ``Idempotency-Key``.

The coordinator then *adopts* the request in the verifier (``Adopt``): the verifier relays it
here from now on and first replays its events so far, which this coordinator turns into the same
chunks at the same positions (``stream_ids.py``) and sends from the one after the client's. The
text is generated once. A request nobody opened yet (its queue died with its coordinator) is
opened here, target-only.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import msgspec

from services.coordinator.adoption import adopt, check_position, stream_not_found
from services.coordinator.errors import ApiError, invalid_request, service_unavailable
from services.coordinator.generation import Generator, Submission
from services.coordinator.openai_api import GenerationRequest, Kind, ResponseMode
from services.coordinator.stream_ids import NONE_YET, BadEventId, parse_event_id
from services.coordinator.stream_store import StoreError, StreamRecord, StreamStore, key_hash
from services.coordinator.verifier_link import FrontendLink
from services.coordinator.verifier_pool import VerifierPool
from shared.log import get_logger

log = get_logger("coordinator.resumption")
CLAIM_WAIT_S = 5.0  # an Idempotency-Key retry waits this long for the first request's record
#: a coordinator just started knows whether streams resume (the verifier's grace) only once a verifier
#: has welcomed it: a resume waits this long for that, then gets a 503 to retry
WELCOME_WAIT_S = 10.0


@dataclass
class Resumption:
    """A request taken over: its record, one Submission per choice (none when ``record.result``
    already holds the whole answer), and the last position the client received of each choice."""

    record: StreamRecord
    subs: list[Submission]
    after: list[int]

    @property
    def kind(self) -> Kind:
        return "chat" if self.record.kind == "chat" else "completion"

    @property
    def mode(self) -> ResponseMode:
        r = self.record
        return ResponseMode(stream=r.stream, include_usage=r.include_usage, continuous_usage=r.continuous_usage)


def fingerprint(kind: str, body: dict[str, Any]) -> str:
    """What an Idempotency-Key's retry must repeat: the endpoint and the body (as JSON, keys sorted)."""
    canonical = json.dumps({"kind": kind, **body}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class Resumes:
    def __init__(self, store: StreamStore, generator: Generator, link: FrontendLink | VerifierPool, node_id: str,
                 timeout_s: float, secret: str = "") -> None:
        self.store = store
        self._generator = generator
        self._link = link
        self._node_id = node_id
        self._timeout_s = timeout_s
        self._secret = secret  # keys of the API keys in the store (HMAC): the fleet's --auth-token

    def _key(self, client: str) -> str:
        return key_hash(client, self._secret)

    @property
    def enabled(self) -> bool:
        """Resume needs a verifier that keeps released requests (``--orphan-grace-s`` > 0)."""
        return self._link.grace_s > 0

    def _ttl(self) -> float:
        return self._timeout_s + self._link.grace_s

    # --- recording -----------------------------------------------------------------------

    async def record(self, client: str, req: GenerationRequest, subs: list[Submission], created: int,
                     idempotency_key: str = "", websocket: bool = False, body_print: str = "") -> StreamRecord | None:
        """Store how a new streamed (SSE or ``websocket``) or idempotent request was opened; its subs
        become resumable. A store that fails only costs resumability (logged)."""
        stream = req.mode.stream or websocket
        if not self.enabled or not (stream or idempotency_key):
            return None
        opened = [sub.opened for sub in subs if sub.opened is not None]
        record = StreamRecord(request_id=subs[0].request_id, key=self._key(client), kind=req.kind, model=req.model,
                              created=created, opened=opened, owner=self._node_id, stream=stream,
                              include_usage=req.mode.include_usage, continuous_usage=req.mode.continuous_usage,
                              echo=req.echo, fingerprint=body_print)
        try:
            await self.store.put(record, self._ttl())
        except StoreError as exc:
            log.warning("stream not recorded; it cannot be resumed", request_id=record.request_id, error=str(exc))
            return None
        for sub in subs:
            sub.resumable = True
        return record

    async def finished(self, record: StreamRecord, body: dict[str, Any]) -> None:
        """Keep a finished non-streamed answer for an Idempotency-Key retry, for the grace."""
        try:
            await self.store.put(msgspec.structs.replace(record, result=json.dumps(body).encode()),
                                 self._link.grace_s)
        except StoreError as exc:
            log.warning("finished answer not kept for retries", request_id=record.request_id, error=str(exc))

    async def _heard_verifier(self) -> None:
        """Wait (up to WELCOME_WAIT_S) until a verifier has welcomed this coordinator: before that,
        ``enabled`` cannot tell whether streams resume, and a client resuming at a coordinator just
        restarted would be told its stream is unknown. 503 past the wait."""
        if not self._link.welcomed and not await self._link.wait_connected(WELCOME_WAIT_S):
            raise service_unavailable("no verifier has connected to this coordinator yet; retry shortly", 1)

    async def claim(self, client: str, idempotency_key: str, request_id: str) -> str | None:
        """The request already bound to this Idempotency-Key of this client, or None (bound to ``request_id`` now)."""
        if not self.enabled:
            return None
        try:
            return await self.store.claim(self._key(client), idempotency_key, request_id, self._ttl())
        except StoreError as exc:
            raise service_unavailable(f"cannot check the Idempotency-Key: {exc}", 1) from None

    async def unclaim(self, client: str, idempotency_key: str) -> None:
        try:
            await self.store.unclaim(self._key(client), idempotency_key)
        except StoreError as exc:
            log.warning("Idempotency-Key not released", error=str(exc))

    # --- resuming ------------------------------------------------------------------------

    async def from_event_id(self, kind: Kind | None, client: str, value: str) -> Resumption:
        """The stream a ``Last-Event-ID`` names, from the chunk after it (``kind``: the endpoint)."""
        try:
            request_id, after = parse_event_id(value)
        except BadEventId as exc:
            raise invalid_request(str(exc), "Last-Event-ID", "invalid_last_event_id") from None
        return await self.from_position(kind, client, request_id, after)

    async def from_position(self, kind: Kind | None, client: str, request_id: str, after: list[int]) -> Resumption:
        record = await self._find(request_id, client)
        if not record.stream:
            raise invalid_request(f"request {request_id} was not streamed: send it again with the same "
                                  "Idempotency-Key to get its answer", "Last-Event-ID", "not_a_stream")
        if kind is not None and record.kind != kind:
            where = "/v1/chat/completions" if record.kind == "chat" else "/v1/completions"
            raise invalid_request(f"stream {request_id} was opened at {where}: resume it there", None, "wrong_endpoint")
        if len(after) != len(record.opened):
            raise invalid_request(f"stream {request_id} has {len(record.opened)} choices but the Last-Event-ID names "
                                  f"{len(after)} positions", "Last-Event-ID", "invalid_last_event_id")
        return await self._adopt(record, after)

    async def retried(self, client: str, idempotency_key: str, request_id: str, body_print: str,
                      one_choice: bool = False) -> Resumption | None:
        """The request this client's ``idempotency_key`` is bound to (its kept answer, or its stream
        from the start), or None: the key is bound to ``request_id`` now, for a new request (also
        when the request it named can no longer be resumed: it is made again). 422 when the key
        was used with another request (``body_print``: :func:`fingerprint`)."""
        for _ in range(2):
            bound = await self.claim(client, idempotency_key, request_id)
            if bound is None:
                return None
            try:
                record = await self._find(bound, client, wait_s=CLAIM_WAIT_S)
                _check_retry(record, body_print, one_choice)
                if record.result:
                    return Resumption(record, [], [])
                return await self._adopt(record, [NONE_YET] * len(record.opened))
            except ApiError as exc:
                if exc.code != "stream_not_found":
                    raise
                log.info("Idempotency-Key named a request that cannot be resumed; made again", request_id=bound)
                await self.unclaim(client, idempotency_key)
        raise service_unavailable("the Idempotency-Key is being used by another request right now; retry", 1)

    async def cancel(self, client: str, request_id: str) -> None:
        """Stop a resumable request for good (its client will not come back): take it over, then
        cancel it in the verifier. 404 as for a resume."""
        record = await self._find(request_id, client)
        taken = await self._adopt(record, [NONE_YET] * len(record.opened))
        for sub in taken.subs:
            sub.resumable = False
            sub.close()  # sends Cancel: the verifier has not reported it finished to this Submission
        log.info("stream cancelled by its client", request_id=request_id)

    async def _find(self, request_id: str, client: str, wait_s: float = 0.0) -> StreamRecord:
        await self._heard_verifier()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            try:
                record = await self.store.get(request_id) if self.enabled else None
            except StoreError as exc:
                raise service_unavailable(f"cannot look up stream {request_id}: {exc}", 1) from None
            if record is not None or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)  # the first request of this Idempotency-Key is still being recorded
        if record is None or record.key != self._key(client):  # another key's stream: as if unknown
            raise stream_not_found(request_id)
        return record

    async def _adopt(self, record: StreamRecord, after: list[int]) -> Resumption:
        subs: list[Submission] = []
        try:
            for i, opened in enumerate(record.opened):
                sub = self._generator.follow(opened, self._generator.admission.admit())
                sub.resumable = True
                subs.append(sub)
                reply = await adopt(self._link, sub.request_id, opened, self._node_id)
                check_position(record.request_id, i, after[i], reply)
                if reply.first_seq > 1:  # its first events are gone: a verifier restart could not re-open it
                    self._link.routing.ledger.forget(sub.request_id)
            await self.store.put(msgspec.structs.replace(record, owner=self._node_id), self._ttl())
        except StoreError as exc:
            log.warning("stream owner not updated", request_id=record.request_id, error=str(exc))
        except BaseException:
            for sub in subs:
                sub.close()
            raise
        log.info("stream resumed", request_id=record.request_id, after=after, choices=len(subs))
        return Resumption(record, subs, after)


def _check_retry(record: StreamRecord, body_print: str, one_choice: bool) -> None:
    """An Idempotency-Key's retry must be the same request (and one choice, over /v1/stream)."""
    if record.fingerprint and body_print and record.fingerprint != body_print:
        raise ApiError(422, "this Idempotency-Key was used with another request: send the same request with it, "
                            "or another key", "invalid_request_error", "Idempotency-Key", "idempotency_key_reused")
    if one_choice and len(record.opened) != 1:
        raise invalid_request(f"request {record.request_id} is not a one-choice stream: /v1/stream cannot resume it")
