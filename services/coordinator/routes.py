"""The coordinator's HTTP endpoints: OpenAI completions, the model list, health, readiness, metrics.

Each handler is thin: check the key, take an admission slot (429 at --max-in-flight), parse the
body (openai_api), queue it (generation), then either collect the result or hand the stream to
stream.py. Every request is counted in the metrics exactly once with the status it really ended
with, and its admission slot is released exactly once (by its Submission's close).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response, WebSocket
from fastapi.responses import JSONResponse

from services.coordinator.errors import ApiError, unauthorized
from services.coordinator.generation import ClientGone, Collected, Submission, collect, new_request_id
from services.coordinator.metrics import CONTENT_TYPE, RequestTimer
from services.coordinator.openai_api import GenerationRequest, Kind, given, parse_json
from services.coordinator.responses import Responder
from services.coordinator.resumption import Resumption, fingerprint
from services.coordinator.state import CoordinatorState, state_of
from services.coordinator.stream import SubmissionStream, websocket_session
from services.coordinator.stream_store import StreamRecord
from shared.log import get_logger

log = get_logger("coordinator.routes")

router = APIRouter()
T = TypeVar("T")
MAX_BODY_BYTES = 16 * 1024 * 1024


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    return await _complete("chat", request)


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    return await _complete("completion", request)


async def _complete(kind: Kind, request: Request) -> Response:
    state = state_of(request)
    timer = state.metrics.start("chat" if kind == "chat" else "completions")
    try:
        if not state.authorized(request.headers.get("authorization")):
            raise unauthorized()
        client = request.headers.get("authorization", "")
        last_event_id = request.headers.get("last-event-id")
        if last_event_id is not None:  # a stream's client is back (resumption.py)
            state.limiter.admit(client)
            return await _resumed(request, await state.resumes.from_event_id(kind, client, last_event_id), timer)
        return await _new(kind, request, timer, client, request.headers.get("idempotency-key", "").strip())
    except ApiError as exc:
        timer.finish(exc.status)
        return exc.response()
    except ClientGone:
        timer.finish(ClientGone.status)
        return Response(status_code=ClientGone.status)
    except BaseException:
        timer.finish(500)
        raise


async def _new(kind: Kind, request: Request, timer: RequestTimer, client: str, idempotency_key: str) -> Response:
    """A new request; with an Idempotency-Key already used by this client, the request it made."""
    state = state_of(request)
    rid = new_request_id()
    if not idempotency_key:
        return await _made(kind, request, timer, client, rid)
    body = await _read_json(request)  # what a retry must repeat
    body_print = fingerprint(kind, body)
    if (taken := await state.resumes.retried(client, idempotency_key, rid, body_print)) is not None:
        state.limiter.admit(client)
        return await _resumed(request, taken, timer)
    try:
        return await _made(kind, request, timer, client, rid, (idempotency_key, body_print), body)
    except ClientGone:  # its retry takes the request over
        raise
    except BaseException:  # let a retry try again rather than find this failure
        await state.resumes.unclaim(client, idempotency_key)
        raise


async def _made(kind: Kind, request: Request, timer: RequestTimer, client: str, rid: str,
                idempotent: tuple[str, str] = ("", ""), body: dict[str, Any] | None = None) -> Response:
    """Admit, record and queue request ``rid``, then answer it (``body``: read already). The stream
    is recorded before any choice goes out: a coordinator killed in between leaves nothing running
    that a retry (Idempotency-Key) or resume elsewhere would not find."""
    state = state_of(request)
    req, first = await state.start(kind, (lambda: given(body)) if body is not None else lambda: _read_json(request),
                                   client, rid, send=False)
    subs = [first]
    try:
        subs += await state.more_choices(req, send=False)
        responder = Responder(kind, rid, req.model, int(time.time()), req.mode,
                              state.logprobs_formatter(kind, req.params), req.echo, len(req.prompt_ids))
    except BaseException:
        for sub in subs:
            sub.close()
        raise
    record = await _record(state, client, req, subs, responder.created, idempotent)
    await state.send(client, req, subs)
    return await _respond(request, subs, responder, timer, record)


async def _record(state: CoordinatorState, client: str, req: GenerationRequest, subs: list[Submission],
                  created: int, idempotent: tuple[str, str]) -> StreamRecord | None:
    try:
        return await state.resumes.record(client, req, subs, created, idempotent[0], body_print=idempotent[1])
    except BaseException:
        for sub in subs:
            sub.close()
        raise


async def _resumed(request: Request, taken: Resumption, timer: RequestTimer) -> Response:
    """Answer for a request taken over: its kept answer, or its stream from the client's position."""
    record, state = taken.record, state_of(request)
    if record.result:
        timer.finish(200)
        return Response(record.result, media_type="application/json")
    opened = record.opened[0]
    responder = Responder(taken.kind, record.request_id, record.model, record.created, taken.mode,
                          state.logprobs_formatter(taken.kind, opened.params), record.echo, len(opened.prompt_ids))
    return await _respond(request, taken.subs, responder, timer, record, taken.after)


async def _respond(request: Request, subs: list[Submission], responder: Responder, timer: RequestTimer,
                   record: StreamRecord | None, after: list[int] | None = None) -> Response:
    """Stream the submissions (from the chunk after ``after``), or collect them into one body (kept
    in the stream store for an Idempotency-Key retry when the request is recorded)."""
    if responder.mode.stream:
        return await _stream(request, subs, responder, timer, after)
    try:
        body = responder.full(await _unless_client_leaves(request, subs, _collect_all(subs)))
    finally:
        for sub in subs:
            sub.close()
    if record is not None:
        await state_of(request).resumes.finished(record, body)
    timer.finish(200)
    return JSONResponse(body)


async def _collect_all(subs: list[Submission]) -> list[Collected]:
    """Every choice to its end; the first failure ends them all."""
    tasks = [asyncio.create_task(collect(sub), name=f"collect-{sub.request_id}") for sub in subs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _stream(request: Request, subs: list[Submission], responder: Responder, timer: RequestTimer,
                  after: list[int] | None = None) -> Response:
    """Wait for each choice's first event before committing to a 200 event stream, so that a
    request refused at once (verifier busy, failed, timed out) still gets its real status and
    Retry-After."""
    try:
        for sub in subs:
            await _unless_client_leaves(request, subs, sub.started())
    except BaseException:
        for sub in subs:
            sub.close()
        raise
    return SubmissionStream(subs, responder, timer, state_of(request).metrics, after)


async def _read_json(request: Request) -> dict[str, Any]:
    return parse_json(await _read_body(request))


async def _read_body(request: Request) -> bytes:
    """The body, refusing (413) one larger than any prompt that fits a context could need."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large() -> ApiError:
    return ApiError(413, f"the request body exceeds {MAX_BODY_BYTES // (1024 * 1024)} MiB",
                    "invalid_request_error", None, "request_too_large")


async def _unless_client_leaves(request: Request, subs: list[Submission], work: Awaitable[T]) -> T:
    """Await ``work`` (on the ``subs``' events), but abort them if the client disconnects meanwhile."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, subs), name="disconnect-watch")
    try:
        return await work
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _abort_on_disconnect(request: Request, subs: list[Submission]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for sub in subs:
                sub.abort("the client disconnected")
            return


@router.delete("/v1/streams/{request_id}", response_model=None)
async def cancel_stream(request_id: str, request: Request) -> Response:
    """Stop a resumable request for good: a client that disconnected will not come back for it."""
    state = state_of(request)
    client = request.headers.get("authorization", "")
    try:
        if not state.authorized(client):
            raise unauthorized()
        state.limiter.admit(client)
        await state.resumes.cancel(client, request_id.removeprefix("chatcmpl-").removeprefix("cmpl-"))
    except ApiError as exc:
        return exc.response()
    return JSONResponse({"id": request_id, "object": "stream", "cancelled": True})


@router.websocket("/v1/stream")
async def stream_ws(websocket: WebSocket) -> None:
    state: CoordinatorState = websocket.app.state.coordinator
    await websocket_session(websocket, state)


@router.get("/v1/models", response_model=None)
async def models(request: Request) -> Response:
    state = state_of(request)
    if not state.authorized(request.headers.get("authorization")):
        return unauthorized().response()
    card = {
        "id": state.model.served_name,
        "object": "model",
        "created": state.model.created,
        "owned_by": "specfleet",
        "root": state.model.root,
        "parent": None,
        "max_model_len": state.max_model_len(),
    }
    return JSONResponse({"object": "list", "data": [card]})


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", response_model=None)
async def ready(request: Request) -> Response:
    """200 only when the verifier is linked and >= 1 drafter is up (just the verifier with speculation off)."""
    state = state_of(request)
    link = state.link
    missing = state.missing()
    body = {
        "status": "ready" if not missing else "not_ready",
        "verifier_connected": link.connected,
        "drafters": list(link.drafters),
        "missing": missing,
    }
    return JSONResponse(body, status_code=200 if not missing else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = state_of(request)
    try:
        async with asyncio.timeout(2.0):
            depth = await state.queue.depth()
    except Exception as exc:  # an unreachable queue must not break the scrape; -1 flags it
        log.warning("queue depth unavailable for /metrics; reported as -1", error=repr(exc))
        depth = -1
    data = state.metrics.render(depth, len(state.link.drafters), state.link.connected)
    return Response(data, media_type=CONTENT_TYPE)
