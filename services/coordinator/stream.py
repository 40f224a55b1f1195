"""Streaming out: Server-Sent Events for the OpenAI endpoints, and the ``/v1/stream`` WebSocket.

SSE follows OpenAI: ``data: {chunk}\\n\\n`` per chunk, ``data: [DONE]\\n\\n`` at the end, and an
error that happens after the stream started is sent as ``data: {"error": {...}}`` (stock clients
raise it). The WebSocket protocol is documented in services/coordinator/README.md.

Both observe ``relay_seconds``: from the arrival of an event's frame from the verifier to the
moment its bytes were handed to the server for the client (the ASGI send returned).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.coordinator.errors import ApiError, invalid_request, unauthorized
from services.coordinator.generation import ClientGone, Submission, new_request_id
from services.coordinator.logprobs import LogprobsFormatter
from services.coordinator.metrics import CoordinatorMetrics, RequestTimer
from services.coordinator.openai_api import Kind, given, parse_json
from services.coordinator.responses import Responder, finish_reason, speculation, usage
from services.coordinator.resumption import Resumption, fingerprint
from services.coordinator.state import CoordinatorState
from services.coordinator.stream_ids import ECHO, NONE_YET, ROLE, event_id, finish_pos, text_pos, usage_pos
from shared.log import get_logger
from shared.protocol import TokenEvent

log = get_logger("coordinator.stream")
DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any], event_id: str = "") -> bytes:
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return b"id: " + event_id.encode() + b"\n" + data if event_id else data


class Positions:
    """The last position sent of each choice (stream_ids.py); chunks at or before ``after`` (what
    a resuming client already has) are skipped."""

    def __init__(self, request_id: str, choices: int, after: list[int] | None = None) -> None:
        self.request_id = request_id
        self.after = list(after) if after is not None else [NONE_YET] * choices
        self.sent = list(self.after)

    def chunk(self, choice: int, position: int, obj: Callable[[], dict[str, Any]]) -> bytes | None:
        """The chunk at ``position`` of ``choice`` with its event id, or None when the client has it."""
        if position <= self.after[choice]:
            return None
        self.sent[choice] = position
        return sse(obj(), event_id(self.request_id, self.sent))


async def sse_body(subs: list[Submission], responder: Responder, timer: RequestTimer, metrics: CoordinatorMetrics,
                   after: list[int] | None = None) -> AsyncIterator[bytes]:
    """The SSE byte stream of one request (one submission per choice), from the chunk after
    ``after``; always closes the submissions and the timer."""
    status = 499  # if the client goes away, this generator is cancelled before setting another
    at = Positions(responder.request_id, len(subs), after)
    try:
        generated, finals = 0, {}
        for chunk in _opening_chunks(at, responder, len(subs)):
            yield chunk
        async for i, event in merged(subs):
            generated += len(event.token_ids)
            for chunk in _event_chunks(at, responder, i, event, generated):
                yield chunk
            if event.finished:
                finals[i] = event
            if event.text or event.finished:  # resumed here: the server's send of its bytes returned
                metrics.relayed("sse", subs[i].arrived)
        if responder.mode.include_usage:
            usage_chunk = at.chunk(0, usage_pos(finals[0].seq),
                                   lambda: responder.usage_chunk(*(finals[i] for i in range(len(subs)))))
            if usage_chunk is not None:
                yield usage_chunk
        status = 200
    except ApiError as exc:
        status = exc.status
        yield sse(exc.body())
    except ClientGone:
        return
    finally:
        for sub in subs:
            sub.close()
        timer.finish(status)
    yield DONE


def _opening_chunks(at: Positions, responder: Responder, choices: int) -> list[bytes]:
    """Each choice's role chunk (chat) and echo text, those the client does not have yet."""
    out = []
    for i in range(choices):
        if responder.kind == "chat":
            out.append(at.chunk(i, ROLE, partial(responder.chunk, "", first=True, index=i)))
        if responder.echo:
            out.append(at.chunk(i, ECHO, partial(responder.chunk, responder.echo, index=i)))
    return [chunk for chunk in out if chunk is not None]


def _event_chunks(at: Positions, responder: Responder, i: int, event: TokenEvent, generated: int) -> list[bytes]:
    """The chunks of one event of choice ``i`` the client does not have yet: its text, its finish."""
    out = []
    if event.text or (responder.logprobs is not None and event.token_ids):
        out.append(at.chunk(i, text_pos(event.seq), lambda: responder.chunk(event.text, event=event,
                                                                            generated=generated, index=i)))
    if event.finished:
        out.append(at.chunk(i, finish_pos(event.seq), lambda: responder.chunk("", finish_reason(event),
                                                                              generated=generated, index=i)))
    return [chunk for chunk in out if chunk is not None]


async def merged(subs: list[Submission]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The events of every choice as they come, each with its choice's index, up to the last
    choice's final event; the first failure (ApiError, ClientGone) is raised and ends them all."""
    if len(subs) == 1:
        async for event in subs[0].events():
            yield 0, event
        return
    inbox: asyncio.Queue[tuple[int, TokenEvent | Exception]] = asyncio.Queue()

    async def pump(i: int, sub: Submission) -> None:
        try:
            async for event in sub.events():
                inbox.put_nowait((i, event))
        except Exception as exc:  # ApiError, ClientGone: handed to the reader, which raises it
            inbox.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, sub), name=f"choice-{i}") for i, sub in enumerate(subs)]
    try:
        left = len(subs)
        while left:
            i, item = await inbox.get()
            if isinstance(item, Exception):
                raise item
            yield i, item
            left -= item.finished
    finally:
        for task in tasks:
            task.cancel()


class SubmissionStream(StreamingResponse):
    """The SSE response of one submission. Closing the submission here as well as in the body
    covers a client that leaves before the body generator even starts (its finally never runs)."""

    def __init__(self, subs: list[Submission], responder: Responder, timer: RequestTimer,
                 metrics: CoordinatorMetrics, after: list[int] | None = None) -> None:
        super().__init__(sse_body(subs, responder, timer, metrics, after), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  "X-Request-Id": responder.request_id})
        self._subs = subs
        self._timer = timer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for sub in self._subs:
                sub.close()
            self._timer.finish(ClientGone.status)


# --- the /v1/stream WebSocket -----------------------------------------------------------------

#: Request frames one socket may have waiting while it serves another. Past this the socket is
#: not read until the current request ends (TCP pushes back on the client), so a client that
#: pipelines without limit cannot make the coordinator buffer its frames without limit.
MAX_PIPELINED = 16


@dataclass
class _Conn:
    """One client socket: frames it sent that wait their turn, and the request being served."""

    inbox: asyncio.Queue[str | bytes | None]
    current: Submission | None = None
    gone: bool = False
    client: str = ""  # the Authorization header: whose rate limit and quota the requests use


_CLOSE_CODES = {503: 1013, 504: 1011, 500: 1011}  # 4xx -> 1008 (policy violation)


async def websocket_session(ws: WebSocket, state: CoordinatorState) -> None:
    """Serve requests sent on one socket, one after the other, until it closes or one fails."""
    await ws.accept()
    if not state.authorized(ws.headers.get("authorization")):
        await _fail(ws, unauthorized())
        return
    conn = _Conn(inbox=asyncio.Queue(maxsize=MAX_PIPELINED), client=ws.headers.get("authorization", ""))
    reader = asyncio.create_task(_read(ws, conn), name="ws-reader")
    try:
        while not conn.gone and (frame := await conn.inbox.get()) is not None:
            if not await _serve_frame(ws, state, conn, frame):
                return
    finally:
        reader.cancel()


async def _read(ws: WebSocket, conn: _Conn) -> None:
    """Receive frames; on disconnect, abort the request being served and stop the session."""
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            await conn.inbox.put(message.get("text") if message.get("text") is not None else message.get("bytes"))
    except (WebSocketDisconnect, RuntimeError):
        pass
    conn.gone = True
    if conn.current is not None:
        conn.current.abort("the client closed the WebSocket")
    await conn.inbox.put(None)


async def _serve_frame(ws: WebSocket, state: CoordinatorState, conn: _Conn, frame: str | bytes) -> bool:
    """Serve one request frame; False when the socket must close (an error, or the client left).

    An overload refusal (429 at the in-flight cap or a full queue, 503 when the verifier is busy)
    ends only this request: its error frame says when to retry and the socket stays open.
    """
    timer = state.metrics.start("stream")
    status = 499
    try:
        sub, formatter, echo, after = await _start(state, conn, frame)
        conn.current = sub
        if conn.gone:  # the client left while we were tokenizing or queueing
            sub.abort("the client closed the WebSocket")
        try:
            status = await _relay(ws, sub, state.metrics, formatter, echo, after)
        finally:
            conn.current = None
            sub.close()
        return status == 200
    except ApiError as exc:
        status = exc.status
        if exc.retry_after is not None:
            return await _refuse(ws, exc)
        await _fail(ws, exc)
        return False
    finally:
        timer.finish(status)


async def _start(state: CoordinatorState, conn: _Conn, frame: str | bytes
                 ) -> tuple[Submission, LogprobsFormatter | None, str, int]:
    """The request a frame starts (or resumes): its submission, logprobs formatter, echo text, and
    the index of the last frame its client has (a resume) or -1."""
    if not isinstance(frame, str):
        raise invalid_request("send each request as one JSON text frame, not a binary frame")
    body = parse_json(frame)
    if body.get("type") == "resume":
        return await _resume(state, conn, body)
    key = body.pop("idempotency_key", "")
    if not isinstance(key, str):
        raise invalid_request("'idempotency_key' must be a string", "idempotency_key")
    kind, body = _parse_request(body)
    rid, body_print = new_request_id(), fingerprint(kind, body)
    if key and (taken := await state.resumes.retried(conn.client, key, rid, body_print, one_choice=True)):
        state.limiter.admit(conn.client)
        return _taken(state, taken, NONE_YET)
    try:
        req, sub = await state.start(kind, lambda: given(body), conn.client, rid, send=False)
        try:
            formatter = state.logprobs_formatter(kind, req.params)
            await state.resumes.record(conn.client, req, [sub], int(time.time()), key, websocket=True,
                                       body_print=body_print)
        except BaseException:
            sub.close()
            raise
        await state.send(conn.client, req, [sub])  # recorded first: see routes._made
    except BaseException:
        if key:
            await state.resumes.unclaim(conn.client, key)
        raise
    return sub, formatter, req.echo, NONE_YET


async def _resume(state: CoordinatorState, conn: _Conn, body: dict[str, Any]
                  ) -> tuple[Submission, LogprobsFormatter | None, str, int]:
    """``{"type": "resume", "request_id": ..., "index": <last index received>}`` (resumption.py)."""
    rid, index = body.get("request_id"), body.get("index", NONE_YET)
    if not isinstance(rid, str) or not rid:
        raise invalid_request("a resume frame needs the 'request_id' of the stream", "request_id")
    if not isinstance(index, int) or isinstance(index, bool) or index < NONE_YET:
        raise invalid_request("'index' must be the index of the last frame received (an integer), or -1",
                              "index")
    state.limiter.admit(conn.client)
    return _taken(state, await state.resumes.from_position(None, conn.client, rid, [index]), index)


def _taken(state: CoordinatorState, taken: Resumption, after: int
           ) -> tuple[Submission, LogprobsFormatter | None, str, int]:
    record = taken.record
    if len(taken.subs) != 1:
        for sub in taken.subs:
            sub.close()
        raise invalid_request(f"request {record.request_id} is not a one-choice stream: /v1/stream cannot resume it")
    return taken.subs[0], state.logprobs_formatter(taken.kind, record.opened[0].params), record.echo, after


def _parse_request(body: dict[str, Any]) -> tuple[Kind, dict[str, Any]]:
    kind = body.pop("kind", None)
    if kind not in ("chat", "completion"):
        raise invalid_request(f"'kind' must be \"chat\" or \"completion\", got {kind!r}", "kind")
    if body.get("n") not in (None, 1):
        raise invalid_request("/v1/stream serves one choice per request: send n=1 (or several requests), "
                              "or use the HTTP endpoints for n > 1", "n")
    body.pop("stream", None)
    body.pop("stream_options", None)
    return cast(Kind, kind), body


async def _relay(ws: WebSocket, sub: Submission, metrics: CoordinatorMetrics,
                 logprobs: LogprobsFormatter | None = None, echo: str = "", after: int = NONE_YET) -> int:
    """Forward the submission's events as frames (after the ``echo`` text, if any), each with its
    ``index`` (stream_ids.py), from the one after ``after``; the status it ended with (499: client gone)."""
    rid = sub.request_id
    try:
        if echo and after < ECHO:
            await ws.send_text(_dump({"type": "token", "request_id": rid, "index": ECHO, "text": echo,
                                      "token_ids": []}))
        async for event in sub.events():
            if (event.token_ids or event.text) and text_pos(event.seq) > after:
                frame: dict[str, Any] = {"type": "token", "request_id": rid, "index": text_pos(event.seq),
                                         "text": event.text, "token_ids": list(event.token_ids)}
                if logprobs is not None:
                    frame["logprobs"] = logprobs.format(list(event.token_ids), list(event.logprobs or []))
                await ws.send_text(_dump(frame))
            if event.finished and finish_pos(event.seq) > after:
                await ws.send_text(_dump({"type": "done", "request_id": rid, "index": finish_pos(event.seq),
                                          "finish_reason": finish_reason(event), "usage": usage(event),
                                          "specfleet": speculation(event)}))
            if event.token_ids or event.text or event.finished:
                metrics.relayed("websocket", sub.arrived)
    except ClientGone:
        return 499
    except (WebSocketDisconnect, RuntimeError, OSError):
        sub.abort("the client closed the WebSocket")
        return 499
    return 200


async def _refuse(ws: WebSocket, exc: ApiError) -> bool:
    """Send an overload refusal, with ``retry_after`` (seconds), and keep the socket; False when
    the client is already gone."""
    try:
        await ws.send_text(_dump({"type": "error", "error": exc.body()["error"], "retry_after": exc.retry_after}))
    except (WebSocketDisconnect, RuntimeError, OSError):
        return False
    return True


async def _fail(ws: WebSocket, exc: ApiError) -> None:
    """Send the error frame and close; the client may already be gone, which is fine."""
    try:
        await ws.send_text(_dump({"type": "error", "error": exc.body()["error"]}))
        await ws.close(_CLOSE_CODES.get(exc.status, 1008), exc.type)
    except (WebSocketDisconnect, RuntimeError, OSError):
        log.debug("websocket client left before the error frame", status=exc.status)


def _dump(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"))
