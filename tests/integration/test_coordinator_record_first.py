"""A resumable request's stream is recorded before the request goes out (``routes._made``,
``stream._start``), in-process against a FakeVerifier.

Recorded after it, a coordinator killed between the two left a request running that nobody could
find: its client's Idempotency-Key retry on another coordinator then made it again, and the
verifier generated it twice (``tests/e2e/test_faults_coordinator.py`` caught it, once in a few runs).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from services.coordinator.model_info import ModelInfo
from shared.protocol import QueuedRequest
from shared.queue import QueueFull
from tests.integration.coordinator_fakes import InProcess, RawWebSocket, in_process, until

pytestmark = pytest.mark.asyncio
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> ModelInfo:
    return ModelInfo.load(str(tiny_models["target"]))


def watch_queue(h: InProcess, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """(request id, whether the stream's record held it already) for each request queued (one
    record per stream, under its first choice's id)."""
    queued: list[tuple[str, bool]] = []
    put = h.queue.put

    async def checked(item: QueuedRequest) -> None:
        record = await h.state.resumes.store.get(queued[0][0] if queued else item.request_id)
        held = record is not None and item.request_id in {o.request_id for o in record.opened}
        queued.append((item.request_id, held))
        await put(item)

    monkeypatch.setattr(h.queue, "put", checked)
    return queued


@pytest.mark.parametrize(("stream", "headers"), [(True, {}), (False, {"Idempotency-Key": "order-1"}),
                                                 (True, {"Idempotency-Key": "order-2"})],
                         ids=["sse", "idempotent", "sse-idempotent"])
async def test_an_http_request_is_recorded_before_it_is_queued(model: ModelInfo, monkeypatch: pytest.MonkeyPatch,
                                                               stream: bool, headers: dict[str, str]) -> None:
    async with in_process(model, orphan_grace_s=30.0) as h:
        queued = watch_queue(h, monkeypatch)
        body: dict[str, Any] = {"prompt": "hello", "max_tokens": 4, "stream": stream, "n": 2}
        resp = await h.http.post(COMP, json=body, headers=headers)
        assert resp.status_code == 200, resp.text
    assert len(queued) == 2 and all(recorded for _, recorded in queued), queued  # both choices


async def test_a_websocket_request_is_recorded_before_it_is_queued(model: ModelInfo,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    async with in_process(model, orphan_grace_s=30.0) as h:
        queued = watch_queue(h, monkeypatch)
        async with RawWebSocket(h.app) as ws:
            tokens, end = await ws.run({"kind": "completion", "prompt": "hello", "max_tokens": 4})
        assert tokens and end["type"] != "error", end
    assert [recorded for _, recorded in queued] == [True]


async def test_a_request_the_queue_refuses_is_closed_and_gives_its_slot_back(model: ModelInfo) -> None:
    """Held until recorded, then refused by a full queue: 429, its slot back, its subscription gone."""
    async with in_process(model, consume=False, max_depth=1, orphan_grace_s=30.0) as h:
        waiting = asyncio.create_task(h.http.post(COMP, json={"prompt": "first", "max_tokens": 4}))
        for _ in range(500):
            if await h.queue.depth() == 1:
                break
            await asyncio.sleep(0.01)
        resp = await h.http.post(COMP, json={"prompt": "second", "max_tokens": 4, "stream": True})
        assert resp.status_code == 429, resp.text
        assert h.in_flight == 1 and len(h.state.link.routing.subs) == 1
        waiting.cancel()


async def test_a_choice_the_queue_refuses_cancels_the_ones_already_sent(model: ModelInfo,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """n = 2, choice 1 refused by the queue: the client gets the 429, so choice 0, queued already,
    is cancelled in the verifier rather than kept for a resume nobody will make."""
    async with in_process(model, consume=False, orphan_grace_s=30.0) as h:
        queued: list[str] = []
        put = h.queue.put

        async def second_refused(item: QueuedRequest) -> None:
            if queued:
                raise QueueFull("1 requests already wait for a drafter")
            queued.append(item.request_id)
            await put(item)

        monkeypatch.setattr(h.queue, "put", second_refused)
        resp = await h.http.post(COMP, json={"prompt": "hello", "max_tokens": 4, "stream": True, "n": 2})
        assert resp.status_code == 429, resp.text
        await until(lambda: queued[0] in h.fake.cancels)
        assert h.in_flight == 0 and not h.state.link.routing.subs
