"""Pure pieces of the coordinator: response shapes, a submission's event handling, the API key."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.coordinator.errors import ApiError
from services.coordinator.generation import ClientGone, Submission
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.responses import Responder
from services.coordinator.verifier_link import VerifierLink
from shared.protocol import TokenEvent

FINAL = TokenEvent(request_id="r", origin="c", token_ids=[1], text="!", finished=True, finish_reason="stop",
                   prompt_tokens=4, completion_tokens=3, drafted_tokens=6, accepted_tokens=2)


def test_chat_body_and_chunks() -> None:
    r = Responder("chat", "abc", "target", 123, include_usage=True)
    body = r.full("hi!", FINAL)
    assert body["id"] == "chatcmpl-abc" and body["object"] == "chat.completion" and body["created"] == 123
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi!"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert body["specfleet"] == {"drafted_tokens": 6, "accepted_tokens": 2}
    assert r.chunk("", first=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    middle = r.chunk("x")
    assert middle["object"] == "chat.completion.chunk" and middle["choices"][0]["delta"] == {"content": "x"}
    assert middle["usage"] is None
    last = r.chunk("", "length")
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert r.usage_chunk(FINAL)["choices"] == [] and r.usage_chunk(FINAL)["usage"]["total_tokens"] == 7


def test_completion_body_and_chunks() -> None:
    r = Responder("completion", "abc", "target", 1)
    body = r.full("xyz", FINAL)
    assert body["id"] == "cmpl-abc" and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "xyz"
    chunk = r.chunk("q")
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == "q" and "usage" not in chunk


def make_sub(timeout_s: float = 5.0) -> tuple[Submission, asyncio.Queue[TokenEvent], VerifierLink]:
    link = VerifierLink("ws://127.0.0.1:1/v1/frontend", "c")  # never started: cancels are dropped
    queue = link.subscribe("r")
    return Submission("r", 9, queue, link, CoordinatorMetrics(), timeout_s), queue, link


async def drain(sub: Submission) -> list[TokenEvent]:
    return [e async for e in sub.events()]


def ev(**kw: Any) -> TokenEvent:
    return TokenEvent(**{"request_id": "r", "origin": "c", "token_ids": [1, 2], "text": "ab", **kw})


@pytest.mark.asyncio
async def test_submission_fills_missing_usage_counts() -> None:
    sub, queue, _ = make_sub()
    queue.put_nowait(ev())
    queue.put_nowait(ev(finished=True, finish_reason="length"))
    events = await drain(sub)
    assert len(events) == 2 and sub.final is not None
    assert (sub.final.prompt_tokens, sub.final.completion_tokens) == (9, 4)


@pytest.mark.asyncio
@pytest.mark.parametrize(("final", "status"), [
    ({"finish_reason": "error", "error": "oom"}, 500),
    ({"finish_reason": "stop", "error": "odd"}, 500),
    ({"finish_reason": "cancelled", "error": "link lost"}, 503),
])
async def test_submission_maps_bad_finals(final: dict[str, Any], status: int) -> None:
    sub, queue, _ = make_sub()
    queue.put_nowait(ev(finished=True, **final))
    with pytest.raises(ApiError) as info:
        await drain(sub)
    assert info.value.status == status


@pytest.mark.asyncio
async def test_submission_times_out_with_504() -> None:
    sub, _, _ = make_sub(timeout_s=0.05)
    with pytest.raises(ApiError) as info:
        await drain(sub)
    assert info.value.status == 504 and info.value.type == "timeout"


@pytest.mark.asyncio
async def test_abort_ends_events_and_close_is_idempotent() -> None:
    sub, queue, link = make_sub()
    queue.put_nowait(ev())
    sub.abort("client left")
    with pytest.raises(ClientGone):
        await drain(sub)
    sub.close()
    sub.close()
    assert "r" not in link._subs


@pytest.mark.parametrize(("key", "header", "ok"), [
    ("", None, True),
    ("k", None, False),
    ("k", "Bearer k", True),
    ("k", " Bearer k ", True),
    ("k", "Bearer K", False),
    ("k", "Basic k", False),
    ("k", "Bearer kk", False),
])
def test_authorized(key: str, header: str | None, ok: bool) -> None:
    from services.coordinator.config import CoordinatorConfig
    from services.coordinator.state import CoordinatorState

    state = CoordinatorState(cfg=CoordinatorConfig(api_key=key), node_id="c", model=None, queue=None,  # type: ignore[arg-type]
                             link=None, generator=None, metrics=None)  # type: ignore[arg-type]
    assert state.authorized(header) is ok
