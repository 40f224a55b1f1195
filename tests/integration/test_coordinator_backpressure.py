"""Backpressure in the coordinator, in-process (the app in the test's loop, a FakeVerifier on
loopback): the in-flight cap (429 + Retry-After on HTTP, SSE and the WebSocket), a busy verifier
(503 + Retry-After), a full in-process queue (429), the relay-time histogram, and the admission
slot coming back exactly once however a request ends. No assertion depends on speed."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.coordinator.model_info import ModelInfo
from shared.protocol import TokenEvent
from tests.integration.coordinator_fakes import InProcess, RawHttp, RawWebSocket, expected_text, in_process, until

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
IN_FLIGHT = "specfleet_coordinator_requests_in_flight"

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> ModelInfo:
    return ModelInfo.load(str(tiny_models["target"]))


def body(path: str, text: str, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    if path == CHAT:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}
    return {"prompt": text, "max_tokens": max_tokens, "stream": stream}


def assert_overload(resp: httpx.Response, status: int, code: str, retry_after: int, needle: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["retry-after"] == str(retry_after)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] is None
    assert err["type"] == ("requests" if status == 429 else "service_unavailable")
    assert needle in err["message"] and f"Retry after {retry_after} s" in err["message"]


async def back_to_zero(h: InProcess) -> None:
    await until(lambda: h.in_flight == 0)
    assert await h.metric(IN_FLIGHT) == 0


@contextlib.asynccontextmanager
async def holding(h: InProcess, n: int = 1) -> Any:
    """``n`` requests that never finish hold admission slots; cancelled (slots back) on exit."""
    tasks = [asyncio.create_task(h.http.post(COMP, json=body(COMP, f"HANG {i}"))) for i in range(n)]
    try:
        await until(lambda: h.in_flight == n)
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


# --- the in-flight cap --------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "stream"), [(CHAT, False), (COMP, False), (CHAT, True), (COMP, True)])
async def test_cap_answers_429_with_retry_after(model: ModelInfo, path: str, stream: bool) -> None:
    async with in_process(model, max_in_flight=1, retry_after_s=2) as h:
        async with holding(h):
            resp = await h.http.post(path, json=body(path, "hello", stream=stream))
            assert_overload(resp, 429, "rate_limit_exceeded", 2, "--max-in-flight")
            assert resp.headers["content-type"].startswith("application/json")
        await back_to_zero(h)
        ok = await h.http.post(path, json=body(path, "hello", stream=stream))
        assert ok.status_code == 200, ok.text
        endpoint = "chat" if path == CHAT else "completions"
        assert await h.metric(f'specfleet_coordinator_requests_total{{endpoint="{endpoint}",status="429"}}') == 1
        assert await h.metric("specfleet_coordinator_max_in_flight") == 1
        await back_to_zero(h)


async def test_cap_on_the_websocket_is_an_error_frame_and_the_socket_stays(model: ModelInfo) -> None:
    async with in_process(model, max_in_flight=1, retry_after_s=2) as h, RawWebSocket(h.app) as ws:
        async with holding(h):
            tokens, frame = await ws.run({"kind": "completion", "prompt": "hello", "max_tokens": 3})
            assert tokens == [] and frame["type"] == "error" and frame["retry_after"] == 2
            err = frame["error"]
            assert (err["type"], err["code"], err["param"]) == ("requests", "rate_limit_exceeded", None)
            assert "--max-in-flight" in err["message"]
        await back_to_zero(h)
        tokens, done = await ws.run({"kind": "chat", "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 3})
        assert done["type"] == "done" and "".join(t["text"] for t in tokens) == expected_text(3)
        assert await h.metric('specfleet_coordinator_requests_total{endpoint="stream",status="429"}') == 1
        await back_to_zero(h)


# --- the slot comes back exactly once, however the request ends --------------------------------


async def ends_finished(h: InProcess) -> None:
    resp = await h.http.post(CHAT, json=body(CHAT, "hi"))
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == expected_text(4)


async def ends_finished_sse(h: InProcess) -> None:
    resp = await h.http.post(COMP, json=body(COMP, "hi", stream=True))
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")


async def ends_bad_request(h: InProcess) -> None:  # admitted, then refused while parsing
    assert (await h.http.post(COMP, json=body(COMP, "hi", max_tokens=0))).status_code == 400


async def ends_verifier_error(h: InProcess) -> None:
    assert (await h.http.post(COMP, json=body(COMP, "FAIL"))).status_code == 500


async def ends_verifier_error_before_the_stream(h: InProcess) -> None:
    resp = await h.http.post(COMP, json=body(COMP, "FAIL", max_tokens=2, stream=True))
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "internal_error"


async def ends_verifier_error_mid_stream(h: InProcess) -> None:
    resp = await h.http.post(COMP, json=body(COMP, "FAIL", max_tokens=4, stream=True))
    assert resp.status_code == 200 and '"error"' in resp.text and resp.text.endswith("data: [DONE]\n\n")


async def ends_timeout(h: InProcess) -> None:
    assert (await h.http.post(COMP, json=body(COMP, "HANG"))).status_code == 504


async def ends_timeout_sse(h: InProcess) -> None:
    assert (await h.http.post(CHAT, json=body(CHAT, "HANG", stream=True))).status_code == 504


async def ends_verifier_busy(h: InProcess) -> None:
    assert (await h.http.post(COMP, json=body(COMP, "BUSY"))).status_code == 503


async def ends_link_drop(h: InProcess) -> None:
    task = asyncio.create_task(h.http.post(COMP, json=body(COMP, "HANG")))
    await until(lambda: len(h.fake.seen) == 1)
    await h.fake.drop_frontends()
    assert (await task).status_code == 503
    await until(lambda: h.state.link.connected)  # it reconnects by itself


async def ends_client_gone(h: InProcess) -> None:
    raw = RawHttp(h.app, COMP, body(COMP, "HANG"))
    task = asyncio.create_task(raw.run())
    await until(lambda: len(h.fake.seen) == 1)
    raw.disconnect()
    await task
    await until(lambda: h.fake.seen[0].request_id in h.fake.cancels)


async def ends_client_gone_before_the_stream(h: InProcess) -> None:
    raw = RawHttp(h.app, COMP, body(COMP, "HANG", stream=True))
    task = asyncio.create_task(raw.run())
    await until(lambda: len(h.fake.seen) == 1)
    raw.disconnect()
    await task
    assert raw.status is None  # nothing was sent: the client left before the first event


async def ends_client_gone_mid_stream(h: InProcess) -> None:
    raw = RawHttp(h.app, COMP, body(COMP, "SLOW", max_tokens=400, stream=True))
    task = asyncio.create_task(raw.run())
    await raw.got_chunk.wait()
    raw.disconnect()
    await task
    assert raw.status == 200
    await until(lambda: h.fake.seen[0].request_id in h.fake.cancels)


async def ends_cancelled(h: InProcess) -> None:  # e.g. the server shutting down under the handler
    task = asyncio.create_task(h.http.post(COMP, json=body(COMP, "HANG")))
    await until(lambda: len(h.fake.seen) == 1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def ends_ws_finished(h: InProcess) -> None:
    async with RawWebSocket(h.app) as ws:
        _, done = await ws.run({"kind": "completion", "prompt": "hi", "max_tokens": 3})
        assert done["type"] == "done"


async def ends_ws_error(h: InProcess) -> None:
    async with RawWebSocket(h.app) as ws:
        _, frame = await ws.run({"kind": "completion", "prompt": "FAIL", "max_tokens": 4})
        assert frame["type"] == "error" and (await ws.receive())["code"] == 1011


async def ends_ws_client_gone(h: InProcess) -> None:
    async with RawWebSocket(h.app) as ws:
        await ws.send_json({"kind": "completion", "prompt": "HANG", "max_tokens": 4})
        await until(lambda: len(h.fake.seen) == 1)
        await ws.disconnect()


ENDINGS: list[tuple[Callable[[InProcess], Awaitable[None]], dict[str, Any]]] = [
    (ends_finished, {}),
    (ends_finished_sse, {}),
    (ends_bad_request, {}),
    (ends_verifier_error, {}),
    (ends_verifier_error_before_the_stream, {}),
    (ends_verifier_error_mid_stream, {}),
    (ends_timeout, {"request_timeout_s": 0.3}),
    (ends_timeout_sse, {"request_timeout_s": 0.3}),
    (ends_verifier_busy, {"speculation": "off"}),
    (ends_link_drop, {}),
    (ends_client_gone, {}),
    (ends_client_gone_before_the_stream, {}),
    (ends_client_gone_mid_stream, {}),
    (ends_cancelled, {}),
    (ends_ws_finished, {}),
    (ends_ws_error, {}),
    (ends_ws_client_gone, {}),
]


@pytest.mark.parametrize(("ending", "cfg"), ENDINGS, ids=[e[0].__name__[5:] for e in ENDINGS])
async def test_the_slot_comes_back_however_the_request_ends(
    model: ModelInfo, ending: Callable[[InProcess], Awaitable[None]], cfg: dict[str, Any]
) -> None:
    async with in_process(model, max_in_flight=1, **cfg) as h:
        await ending(h)
        await back_to_zero(h)
        async with holding(h):  # the one slot is free again, and it is the only one
            assert (await h.http.post(COMP, json=body(COMP, "hi"))).status_code == 429
        await back_to_zero(h)


# --- a busy verifier ------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "stream"), [(CHAT, False), (COMP, False), (COMP, True)])
async def test_busy_verifier_is_503_with_retry_after(model: ModelInfo, path: str, stream: bool) -> None:
    async with in_process(model, speculation="off", retry_after_s=4) as h:
        resp = await h.http.post(path, json=body(path, "BUSY please", stream=stream))
        assert_overload(resp, 503, "verifier_busy", 4, "at capacity")
        assert "the verifier holds 2 sessions" in resp.json()["error"]["message"]
        assert h.fake.opened[-1].speculative is False
        endpoint = "chat" if path == CHAT else "completions"
        assert await h.metric(f'specfleet_coordinator_requests_total{{endpoint="{endpoint}",status="503"}}') == 1
        await back_to_zero(h)


async def test_busy_verifier_on_the_websocket_keeps_the_socket(model: ModelInfo) -> None:
    async with in_process(model, speculation="off", retry_after_s=4) as h, RawWebSocket(h.app) as ws:
        _, frame = await ws.run({"kind": "completion", "prompt": "BUSY", "max_tokens": 3})
        assert frame["type"] == "error" and frame["retry_after"] == 4
        assert frame["error"]["code"] == "verifier_busy" and "at capacity" in frame["error"]["message"]
        tokens, done = await ws.run({"kind": "completion", "prompt": "fine", "max_tokens": 3})
        assert done["type"] == "done" and "".join(t["text"] for t in tokens) == expected_text(3)
        await back_to_zero(h)


async def test_other_verifier_error_frames_stay_500(model: ModelInfo) -> None:
    async with in_process(model, speculation="off") as h:
        resp = await h.http.post(COMP, json=body(COMP, "BROKEN"))
        assert resp.status_code == 500 and "retry-after" not in resp.headers
        err = resp.json()["error"]
        assert err["type"] == "internal_error" and "duplicate: request is already served" in err["message"]
        await back_to_zero(h)


# --- a full in-process queue ----------------------------------------------------------------------


async def test_full_queue_is_429_with_retry_after(model: ModelInfo) -> None:
    async with in_process(model, consume=False, max_depth=1, retry_after_s=3) as h:
        waiting = asyncio.create_task(h.http.post(COMP, json=body(COMP, "first")))
        for _ in range(500):  # until the first request waits in the queue
            if await h.queue.depth() == 1:
                break
            await asyncio.sleep(0.01)
        assert await h.queue.depth() == 1
        resp = await h.http.post(COMP, json=body(COMP, "second", stream=True))
        assert_overload(resp, 429, "rate_limit_exceeded", 3, "queue is full")
        assert "1 requests already wait for a drafter" in resp.json()["error"]["message"]
        assert await h.metric('specfleet_coordinator_requests_total{endpoint="completions",status="429"}') == 1
        assert h.in_flight == 1  # the refused request gave its slot back at once
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await back_to_zero(h)


async def test_a_requests_end_frees_its_drafters_room_before_the_ack(model: ModelInfo) -> None:
    """The queue hears of a request's last token as the coordinator relays it, so a client's next
    request may go to the drafter that is about to ACK (shared/queue_memory.py: whose turn)."""
    async with in_process(model, consume=False, speculation="on") as h:
        waiting = asyncio.create_task(h.http.post(COMP, json=body(COMP, "one")))
        await until(lambda: len(h.queue.waiting_ids()) == 1)
        [d] = await h.queue.get("drafter-1", timeout_s=1, room=1)
        assert h.queue.room() == 0  # its one room is taken
        rid = d.request.request_id
        await h.fake.emit("coord-inproc", TokenEvent(
            request_id=rid, origin="coord-inproc", token_ids=[10], text=" w0", finished=True, finish_reason="length",
            prompt_tokens=len(d.request.prompt_ids), completion_tokens=1, seq=1))
        assert (await waiting).status_code == 200
        assert h.queue.room() == 1  # freed as the last token went out, before any ACK
        await h.queue.ack("drafter-1", d.delivery_id)
        assert h.queue.room() == 1 and h.queue.in_flight() == 0  # the ACK does not count it twice


# --- bursts ---------------------------------------------------------------------------------------


def burst_bodies(n: int, marker: str) -> list[tuple[str, dict[str, Any]]]:
    kinds = [(COMP, False), (CHAT, False), (COMP, True), (CHAT, True)]
    return [(kinds[i % 4][0], body(kinds[i % 4][0], f"{marker} {i}", 3, kinds[i % 4][1])) for i in range(n)]


def check_burst(responses: list[httpx.Response]) -> Counter[int]:
    for resp in responses:
        if resp.status_code == 200:
            if resp.headers["content-type"].startswith("text/event-stream"):
                assert resp.text.endswith("data: [DONE]\n\n") and '"error"' not in resp.text
            else:
                choice = resp.json()["choices"][0]
                assert choice.get("text", choice.get("message", {}).get("content")) == expected_text(3)
        else:
            assert_overload(resp, 429, "rate_limit_exceeded", 1, "--max-in-flight")
    return Counter(resp.status_code for resp in responses)


async def test_burst_of_4n_with_cap_n_held_open(model: ModelInfo) -> None:
    """Every request of the burst arrives while the first N are still generating (they wait at
    the fake verifier's gate): exactly N complete, 3N are refused, none fails."""
    n = 4
    async with in_process(model, max_in_flight=n) as h:
        tasks = [asyncio.create_task(h.http.post(path, json=b)) for path, b in burst_bodies(4 * n, "GATE")]
        await until(lambda: sum(t.done() for t in tasks) == 3 * n)
        await until(lambda: len(h.fake.seen) == n)
        assert h.in_flight == n
        h.fake.gate.set()
        statuses = check_burst(await asyncio.gather(*tasks))
        assert statuses == Counter({200: n, 429: 3 * n})
        await back_to_zero(h)


async def test_free_running_burst_never_fails(model: ModelInfo) -> None:
    n = 4
    async with in_process(model, max_in_flight=n) as h:
        statuses = check_burst(await asyncio.gather(*[h.http.post(p, json=b) for p, b in burst_bodies(4 * n, "go")]))
        assert set(statuses) <= {200, 429} and statuses[200] >= n
        await back_to_zero(h)


# --- the relay-time histogram ---------------------------------------------------------------------


async def test_relay_time_is_observed_per_event_sent(model: ModelInfo) -> None:
    async with in_process(model) as h:
        assert (await h.http.post(COMP, json=body(COMP, "hi", max_tokens=4, stream=True))).status_code == 200
        async with RawWebSocket(h.app) as ws:
            _, done = await ws.run({"kind": "completion", "prompt": "hi", "max_tokens": 6})
            assert done["type"] == "done"
        name = "specfleet_coordinator_relay_seconds"
        assert await h.metric(f'{name}_count{{transport="sse"}}') == 2  # the fake sends two tokens per event
        assert await h.metric(f'{name}_count{{transport="websocket"}}') == 3
        assert await h.metric(f'{name}_bucket{{le="+Inf",transport="websocket"}}') == 3
        text = (await h.http.get("/metrics")).text
        bounds = [line.split('le="')[1].split('"')[0] for line in text.splitlines()
                  if line.startswith(f"{name}_bucket") and 'transport="sse"' in line]
        assert bounds[0] == "5e-05" and bounds[-2:] == ["1.0", "+Inf"]
