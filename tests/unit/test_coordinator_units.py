"""Pure pieces of the coordinator: response shapes, a submission's event handling, the API key."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from services.coordinator.errors import ApiError
from services.coordinator.generation import ClientGone, Collected, Submission
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.openai_api import ResponseMode
from services.coordinator.responses import Responder
from services.coordinator.verifier_link import FrontendLink, Inbound
from shared.protocol import TokenEvent

FINAL = TokenEvent(request_id="r", origin="c", token_ids=[1], text="!", finished=True, finish_reason="stop",
                   prompt_tokens=4, completion_tokens=3, drafted_tokens=6, accepted_tokens=2)


def test_chat_body_and_chunks() -> None:
    r = Responder("chat", "abc", "target", 123, ResponseMode(stream=True, include_usage=True))
    body = r.full([Collected("hi!", FINAL, [], None)])
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
    body = r.full([Collected("xyz", FINAL, [], None)])
    assert body["id"] == "cmpl-abc" and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "xyz"
    chunk = r.chunk("q")
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == "q" and "usage" not in chunk


def make_sub(timeout_s: float = 5.0) -> tuple[Submission, asyncio.Queue[Inbound], FrontendLink]:
    link = FrontendLink("ws://127.0.0.1:1/v1/frontend", "c")  # never started: cancels are dropped
    queue = link.subscribe("r")
    return Submission("r", 9, queue, link, CoordinatorMetrics(), timeout_s, retry_after_s=3), queue, link


def push(queue: asyncio.Queue[Inbound], event: TokenEvent, code: str = "") -> None:
    queue.put_nowait(Inbound(event, time.perf_counter(), code))


async def drain(sub: Submission) -> list[TokenEvent]:
    return [e async for e in sub.events()]


def ev(**kw: Any) -> TokenEvent:
    return TokenEvent(**{"request_id": "r", "origin": "c", "token_ids": [1, 2], "text": "ab", **kw})


@pytest.mark.asyncio
async def test_submission_fills_missing_usage_counts() -> None:
    sub, queue, _ = make_sub()
    push(queue, ev())
    push(queue, ev(finished=True, finish_reason="length"))
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
    push(queue, ev(finished=True, **final))
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
    push(queue, ev())
    sub.abort("client left")
    with pytest.raises(ClientGone):
        await drain(sub)
    sub.close()
    sub.close()
    assert "r" not in link._routing.subs


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
    from shared.config import from_flags

    cfg = from_flags(CoordinatorConfig, api_key=key)
    state = CoordinatorState(cfg=cfg, node_id="c", model=None, queue=None,  # type: ignore[arg-type]
                             link=None, generator=None, resumes=None, metrics=None)  # type: ignore[arg-type]
    assert state.authorized(header) is ok


# --- backpressure -------------------------------------------------------------------------------


def test_in_flight_limit_refuses_at_the_cap_and_releases_once() -> None:
    from prometheus_client import CollectorRegistry, Gauge

    from services.coordinator.admission import InFlightLimit

    registry = CollectorRegistry()
    limit = InFlightLimit(2, retry_after_s=5, gauge=Gauge("g", "in flight", registry=registry))
    a, b = limit.admit(), limit.admit()
    assert limit.in_flight == 2 and registry.get_sample_value("g") == 2
    with pytest.raises(ApiError) as info:
        limit.admit()
    err = info.value
    assert (err.status, err.type, err.code, err.retry_after) == (429, "requests", "rate_limit_exceeded", 5)
    assert err.response().headers["retry-after"] == "5" and "--max-in-flight" in err.message
    a.release()
    a.release()  # idempotent: the count drops once
    assert limit.in_flight == 1 and a.released and not b.released and registry.get_sample_value("g") == 1
    limit.admit()
    assert limit.in_flight == 2


def test_in_flight_limit_zero_means_no_limit() -> None:
    from services.coordinator.admission import InFlightLimit

    limit = InFlightLimit(0, retry_after_s=1)
    slots = [limit.admit() for _ in range(1000)]
    for slot in slots:
        slot.release()
    assert limit.in_flight == 0
    with pytest.raises(ValueError, match="max_in_flight"):
        InFlightLimit(-1, retry_after_s=1)


@pytest.mark.asyncio
async def test_draining_refuses_new_requests_waits_for_in_flight_then_stops() -> None:
    import asyncio

    import uvicorn
    from fastapi import FastAPI

    from services.coordinator.admission import InFlightLimit
    from services.coordinator.drain import DrainingServer, drain_on_signal

    limit = InFlightLimit(0, retry_after_s=1)
    slot = limit.admit()
    server = DrainingServer(uvicorn.Config(FastAPI()))
    drain = asyncio.create_task(drain_on_signal(server, limit, timeout_s=30))
    server.handle_exit(15, None)  # the first SIGTERM asks for a drain, not an exit
    await asyncio.sleep(0.2)
    assert limit.draining and not server.should_exit and not drain.done()
    with pytest.raises(ApiError) as info:
        limit.admit()
    assert info.value.status == 503 and "shutting down" in info.value.message
    slot.release()  # the last request in flight ends: the server may stop
    await asyncio.wait_for(drain, 5)
    assert server.should_exit and not server.force_exit
    server.handle_exit(15, None)  # a second signal stops at once
    assert server.force_exit


@pytest.mark.asyncio
async def test_submission_close_releases_its_slot_once() -> None:
    from services.coordinator.admission import InFlightLimit

    limit = InFlightLimit(1, retry_after_s=1)
    link = FrontendLink("ws://127.0.0.1:1/v1/frontend", "c")
    sub = Submission("r", 1, link.subscribe("r"), link, CoordinatorMetrics(), 5.0, slot=limit.admit())
    assert limit.in_flight == 1
    sub.close()
    sub.close()
    assert limit.in_flight == 0


@pytest.mark.asyncio
async def test_verifier_busy_is_503_with_retry_after() -> None:
    sub, queue, _ = make_sub()
    push(queue, ev(token_ids=[], text="", finished=True, finish_reason="error", error="sessions full"), code="busy")
    with pytest.raises(ApiError) as info:
        await drain(sub)
    err = info.value
    assert (err.status, err.type, err.code, err.retry_after) == (503, "service_unavailable", "verifier_busy", 3)
    assert "at capacity" in err.message and "sessions full" in err.message and "Retry after 3 s" in err.message
    assert err.response().headers["retry-after"] == "3"


@pytest.mark.asyncio
async def test_started_peeks_without_consuming() -> None:
    sub, queue, _ = make_sub()
    push(queue, ev())
    push(queue, ev(finished=True, finish_reason="length"))
    await sub.started()
    await sub.started()  # still the same first event
    assert [e.text for e in await drain(sub)] == ["ab", "ab"]
    busy, busy_queue, _ = make_sub()
    push(busy_queue, ev(finished=True, finish_reason="error", error="full"), code="busy")
    with pytest.raises(ApiError, match="at capacity"):
        await busy.started()


def test_link_routes_batched_events_and_keeps_the_error_code() -> None:
    from shared.protocol import Batch, ErrorFrame, encode

    link = FrontendLink("ws://127.0.0.1:1/v1/frontend", "c")
    busy, broken = link.subscribe("busy"), link.subscribe("broken")
    link._dispatch(encode(Batch(items=[
        TokenEvent(request_id="busy", origin="c", token_ids=[1], text="a"),
        ErrorFrame(code="busy", message="KV cache full", request_id="busy"),
        ErrorFrame(code="duplicate", message="seen it", request_id="broken"),
    ])))
    first, second = busy.get_nowait(), busy.get_nowait()
    assert first.code == "" and first.event.text == "a" and first.arrived <= second.arrived
    assert second.code == "busy" and second.event.finished and second.event.error == "KV cache full"
    other = broken.get_nowait()
    assert other.code == "duplicate" and other.event.finish_reason == "error"
    assert other.event.error == "duplicate: seen it"


@pytest.mark.asyncio
async def test_memory_queue_is_bounded() -> None:
    from shared.protocol import QueuedRequest, SamplingParams
    from shared.queue import QueueError, QueueFull
    from shared.queue_memory import DEFAULT_MAX_DEPTH, MemoryQueue

    def req(i: int) -> QueuedRequest:
        return QueuedRequest(request_id=f"r{i}", prompt_ids=[1], params=SamplingParams(max_tokens=1),
                             origin="c", model="m", created_at=0.0)

    assert MemoryQueue().max_depth == DEFAULT_MAX_DEPTH
    q = MemoryQueue(max_depth=2)
    await q.put(req(0))
    await q.put(req(1))
    with pytest.raises(QueueFull, match="full: 2 requests already wait") as info:
        await q.put(req(2))
    assert isinstance(info.value, QueueError)
    taken = await q.get("d", 2, 0)
    await q.put(req(3))
    await q.put(req(4))
    await q.release("d")  # never drops what it already accepted, even past the bound
    assert await q.depth() == 4
    for d in await q.get("d", 4, 0):
        await q.ack("d", d.delivery_id)
    await q.put(req(5))
    assert [d.request.request_id for d in taken] == ["r0", "r1"]
    unbounded = MemoryQueue(max_depth=0)
    for i in range(DEFAULT_MAX_DEPTH + 1):
        await unbounded.put(req(i))
    with pytest.raises(ValueError, match="max_depth"):
        MemoryQueue(max_depth=-1)


def test_backpressure_settings_are_checked() -> None:
    from services.coordinator.config import CoordinatorConfig, check_config
    from shared.config import ConfigError, from_flags, load_config

    cfg = load_config(CoordinatorConfig, ["--max-in-flight", "8"], env={"SPECFLEET_MAX_QUEUE": "16"})
    assert (cfg.admission.max_in_flight, cfg.admission.max_queue, cfg.admission.retry_after_s) == (8, 16, 1)
    check_config(cfg)
    check_config(from_flags(CoordinatorConfig, max_in_flight=0, max_queue=0))  # 0: no limit
    with pytest.raises(ConfigError, match=r"--max-in-flight must be >= 0.*--max-queue.*--retry-after-s"):
        check_config(from_flags(CoordinatorConfig, max_in_flight=-1, max_queue=-2, retry_after_s=0))
