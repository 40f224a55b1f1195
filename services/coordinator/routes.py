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
from services.coordinator.generation import ClientGone, Collected, Submission, collect
from services.coordinator.logprobs import LogprobsFormatter
from services.coordinator.metrics import CONTENT_TYPE, RequestTimer
from services.coordinator.openai_api import Kind, parse_json
from services.coordinator.responses import Responder
from services.coordinator.state import CoordinatorState, state_of
from services.coordinator.stream import SubmissionStream, websocket_session
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
        req, first = await state.start(kind, lambda: _read_json(request), request.headers.get("authorization", ""))
        try:
            subs = [first, *await state.more_choices(req)]
        except BaseException:
            first.close()
            raise
        formatter = LogprobsFormatter(kind, state.model.token_strings) if req.params.logprobs is not None else None
        responder = Responder(kind, first.request_id, req.model, int(time.time()), req.mode, formatter,
                              req.echo, len(req.prompt_ids))
        if req.mode.stream:
            return await _stream(request, subs, responder, timer)
        try:
            body = await _unless_client_leaves(request, subs, _collect_all(subs))
        finally:
            for sub in subs:
                sub.close()
        timer.finish(200)
        return JSONResponse(responder.full(body))
    except ApiError as exc:
        timer.finish(exc.status)
        return exc.response()
    except ClientGone:
        timer.finish(ClientGone.status)
        return Response(status_code=ClientGone.status)
    except BaseException:
        timer.finish(500)
        raise


async def _collect_all(subs: list[Submission]) -> list[Collected]:
    """Every choice to its end; the first failure ends them all."""
    tasks = [asyncio.create_task(collect(sub), name=f"collect-{sub.request_id}") for sub in subs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _stream(request: Request, subs: list[Submission], responder: Responder, timer: RequestTimer) -> Response:
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
    return SubmissionStream(subs, responder, timer, state_of(request).metrics)


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
