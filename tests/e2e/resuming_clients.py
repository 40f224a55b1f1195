"""Clients that resume their stream after losing their coordinator, as the docs tell users to.

SSE: on a broken connection, POST the same body again with ``Last-Event-ID`` (the ``id:`` of the
last event received) to the next base URL; WebSocket ``/v1/stream``: reconnect and send
``{"type": "resume", "request_id": ..., "index": <last index>}``. A request whose connection broke
before its first event is sent again with the same ``Idempotency-Key`` (every request carries one).
Each checks that the positions it receives only grow (no chunk twice).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets

RETRY_FOR_S = 90.0  # how long a client keeps trying to reconnect
HEADERS = {"Authorization": "Bearer test-key"}


@dataclass
class Resumed:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    resumes: int = 0  # reconnections that went on with the stream
    finish_reason: str = ""


class Progress:
    """Positions received so far (of choice 0): each must be past the last one (no chunk twice).
    A chunk skipped shows in the text, which the tests compare with target-only decoding (an
    event whose text is held back for a stop string has no chunk, so positions may jump)."""

    def __init__(self) -> None:
        self.last = -1

    def take(self, position: int) -> None:
        assert position > self.last, f"position {position} again after {self.last}: a chunk was repeated"
        self.last = position


async def sse_resuming(bases: list[str], body: dict[str, Any], counter: list[int] | None = None,
                       headers: dict[str, str] = HEADERS) -> Resumed:
    """One streamed completion, resumed on ``bases[1:]`` (cycling) whenever its connection breaks."""
    out, progress, last_id, attempt = Resumed(), Progress(), "", 0
    deadline = asyncio.get_running_loop().time() + RETRY_FOR_S
    key = secrets.token_hex(8)  # before any event arrived, a retry names the request by this key
    while True:
        base = bases[attempt % len(bases)]
        sent = {**headers, **({"Last-Event-ID": last_id} if last_id else {"Idempotency-Key": key})}
        try:
            async with httpx.AsyncClient(base_url=base, timeout=60) as http, \
                    http.stream("POST", "/v1/completions", json=body, headers=sent) as resp:
                assert resp.status_code == 200, (resp.status_code, await resp.aread())
                if attempt:
                    out.resumes += 1
                event_id = ""
                async for line in resp.aiter_lines():
                    if line.startswith("id: "):
                        event_id = line[4:]
                    elif line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        progress.take(int(event_id.rsplit(".", 1)[1]))
                        last_id = event_id
                        out.text += chunk["choices"][0]["text"]
                        out.finish_reason = chunk["choices"][0]["finish_reason"] or out.finish_reason
                        if counter is not None:
                            counter[0] += 1
                    elif line == "data: [DONE]":
                        return out
        except (httpx.TransportError, httpx.RemoteProtocolError):
            pass
        assert asyncio.get_running_loop().time() < deadline, "could not resume the stream in time"
        attempt += 1
        await asyncio.sleep(0.2)


async def ws_resuming(urls: list[str], frame: dict[str, Any], counter: list[int] | None = None,
                      headers: dict[str, str] = HEADERS) -> Resumed:
    """One request over ``/v1/stream``, resumed on ``urls[1:]`` (cycling) whenever the socket breaks."""
    out, progress, rid, attempt = Resumed(), Progress(), "", 0
    deadline = asyncio.get_running_loop().time() + RETRY_FOR_S
    frame = {**frame, "idempotency_key": secrets.token_hex(8)}  # names the request before any frame came
    while True:
        try:
            async with websockets.connect(urls[attempt % len(urls)], additional_headers=headers) as ws:
                if rid:
                    await ws.send(json.dumps({"type": "resume", "request_id": rid, "index": progress.last}))
                else:
                    await ws.send(json.dumps(frame))
                out.resumes += attempt > 0
                async for raw in ws:
                    msg = json.loads(raw)
                    assert msg["type"] != "error", msg
                    rid = msg["request_id"]
                    progress.take(msg["index"])
                    if msg["type"] == "token":
                        out.text += msg["text"]
                        out.token_ids += msg["token_ids"]
                        if counter is not None:
                            counter[0] += 1
                    else:
                        out.finish_reason = msg["finish_reason"]
                        return out
        except (OSError, websockets.exceptions.WebSocketException):
            pass
        assert asyncio.get_running_loop().time() < deadline, "could not resume the stream in time"
        attempt += 1
        await asyncio.sleep(0.2)
