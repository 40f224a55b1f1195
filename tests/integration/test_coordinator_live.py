"""The coordinator on a real uvicorn server, linked over a real WebSocket to a fake verifier that
serves the requests it finds in the in-memory queue. Clients: the official ``openai`` package,
raw httpx SSE, and the ``websockets`` client for ``/v1/stream``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from websockets.sync.client import connect as ws_connect

from services.coordinator.model_info import ModelInfo
from tests.integration.coordinator_fakes import SLOW_DELAY_S, LiveCoordinator, expected_text

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def live(tiny_models: dict[str, Path]) -> Iterator[LiveCoordinator]:
    info = ModelInfo.load(str(tiny_models["target"]))
    stack = LiveCoordinator(info.root, info.tokenizer, request_timeout_s=TIMEOUT_S).start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def client(live: LiveCoordinator) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=20) as c:
        yield c


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_ready_when_verifier_and_drafter_are_up(live: LiveCoordinator) -> None:
    resp = httpx.get(live.base_url + "/ready")
    assert resp.status_code == 200, resp.text
    assert resp.json()["drafters"] == ["fake-drafter"]


def test_chat(client: openai.OpenAI, live: LiveCoordinator) -> None:
    out = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=5, temperature=0, seed=7)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text(5)
    assert choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5 and out.usage.prompt_tokens > 0
    assert live.fake is not None
    queued = next(r for r in live.fake.seen if out.id.endswith(r.request_id))
    assert queued.params.temperature == 0 and queued.params.seed == 7 and queued.origin == "coord-test"


def test_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model="target", prompt="def f(x):", max_tokens=4,
                                    extra_body={"top_k": 5, "ignore_eos": True})
    assert out.object == "text_completion"
    assert out.choices[0].text == expected_text(4)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_completion_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    out = client.completions.create(model="target", prompt=["import os"])
    assert out.choices[0].text == expected_text(16)


def test_chat_stream(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(5)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


def test_completion_stream(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="target", prompt="abc", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected_text(3)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_raw_sse_framing(live: LiveCoordinator) -> None:
    body = {"model": "target", "prompt": "abc", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", live.base_url + "/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    # each chunk names its place in the stream (stream_ids.py): id: <request id>.<position>
    rid = resp.headers["x-request-id"]
    assert [e.split("\n")[0] for e in events[:-2]] == [f"id: {rid}.2", f"id: {rid}.3"]
    assert all(e.split("\n")[1].startswith("data: ") for e in events[:-2])
    assert json.loads(events[0].split("\n")[1][6:])["object"] == "text_completion"


def test_verifier_error_is_500(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError, match="boom"):
        client.completions.create(model="target", prompt="FAIL please", max_tokens=4)


def test_verifier_error_mid_stream_is_an_sse_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIError, match="boom"):
        list(client.completions.create(model="target", prompt="FAIL please", max_tokens=4, stream=True))


@pytest.mark.parametrize("stream", [False, True])
def test_verifier_refusal_as_invalid_is_400(client: openai.OpenAI, stream: bool) -> None:
    """A field the verifier's backend does not serve is the client's to fix: 400, before any
    stream starts, with the verifier's reason."""
    with pytest.raises(openai.BadRequestError, match="not supported by the verifier's backend"):
        out = client.completions.create(model="target", prompt="REFUSE please", max_tokens=4, stream=stream)
        if stream:
            list(out)


def test_timeout_is_504_and_cancels(client: openai.OpenAI, live: LiveCoordinator) -> None:
    assert live.fake is not None
    before = len(live.fake.cancels)
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="target", prompt="HANG forever", max_tokens=4)
    assert info.value.status_code == 504
    assert TIMEOUT_S - 0.5 <= time.monotonic() - start < TIMEOUT_S + 5
    assert wait_for(lambda: len(live.fake.cancels) > before)  # type: ignore[union-attr]


def test_sse_client_disconnect_cancels(live: LiveCoordinator) -> None:
    fake = live.fake
    assert fake is not None
    body = {"model": "target", "prompt": "SLOW one", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", live.base_url + "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break
    rid = fake.seen[-1].request_id
    assert wait_for(lambda: rid in fake.cancels), "no Cancel reached the verifier"
    assert rid not in fake.completed


def test_non_streaming_client_disconnect_cancels(live: LiveCoordinator) -> None:
    fake = live.fake
    assert fake is not None
    n_seen = len(fake.seen)
    body = {"model": "target", "prompt": "SLOW two", "max_tokens": 400}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.base_url + "/v1/completions", json=body, timeout=0.5)
    assert wait_for(lambda: len(fake.seen) > n_seen)
    rid = fake.seen[-1].request_id
    assert wait_for(lambda: rid in fake.cancels), "no Cancel reached the verifier"


def ws_url(live: LiveCoordinator) -> str:
    return f"ws://127.0.0.1:{live.port}/v1/stream"


def ws_run(ws: Any, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ws.send(json.dumps(body))
    tokens = []
    while True:
        frame = json.loads(ws.recv(timeout=10))
        if frame["type"] != "token":
            return tokens, frame
        tokens.append(frame)


def test_websocket_sequential_requests(live: LiveCoordinator) -> None:
    with ws_connect(ws_url(live)) as ws:
        tokens, done = ws_run(ws, {"kind": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert "".join(t["text"] for t in tokens) == expected_text(5)
        assert [i for t in tokens for i in t["token_ids"]] == list(range(10, 15))
        assert done["type"] == "done" and done["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == 5
        assert {t["request_id"] for t in tokens} == {done["request_id"]}
        tokens2, done2 = ws_run(ws, {"kind": "completion", "prompt": "x", "max_tokens": 3, "stream": False})
        assert "".join(t["text"] for t in tokens2) == expected_text(3)
        assert done2["request_id"] != done["request_id"]


def test_websocket_pipelined_requests_are_served_in_order(live: LiveCoordinator) -> None:
    with ws_connect(ws_url(live)) as ws:
        for n in (2, 3):
            ws.send(json.dumps({"kind": "completion", "prompt": "x", "max_tokens": n}))
        finals = []
        while len(finals) < 2:
            frame = json.loads(ws.recv(timeout=10))
            if frame["type"] == "done":
                finals.append(frame["usage"]["completion_tokens"])
        assert finals == [2, 3]


@pytest.mark.parametrize(("body", "param"), [
    ({"kind": "poem", "prompt": "x"}, "kind"),
    ({"prompt": "x"}, "kind"),
    ({"kind": "chat", "messages": []}, "messages"),
    ("not json", None),
])
def test_websocket_error_frame_then_close(live: LiveCoordinator, body: Any, param: str | None) -> None:
    with ws_connect(ws_url(live)) as ws:
        ws.send(body if isinstance(body, str) else json.dumps(body))
        frame = json.loads(ws.recv(timeout=10))
        assert frame["type"] == "error"
        assert frame["error"]["type"] == "invalid_request_error" and frame["error"]["param"] == param
        with pytest.raises(Exception, match="1008"):
            ws.recv(timeout=10)


def test_websocket_disconnect_cancels(live: LiveCoordinator) -> None:
    fake = live.fake
    assert fake is not None
    with ws_connect(ws_url(live)) as ws:
        ws.send(json.dumps({"kind": "completion", "prompt": "SLOW three", "max_tokens": 400}))
        frame = json.loads(ws.recv(timeout=10))
        assert frame["type"] == "token"
        rid = frame["request_id"]
    assert wait_for(lambda: rid in fake.cancels), "no Cancel reached the verifier"
    assert rid not in fake.completed
    time.sleep(4 * SLOW_DELAY_S)
    assert httpx.get(live.base_url + "/health").status_code == 200


def test_metrics_after_traffic(client: openai.OpenAI, live: LiveCoordinator) -> None:
    client.completions.create(model="target", prompt="abc", max_tokens=4)
    text = httpx.get(live.base_url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['specfleet_coordinator_requests_total{endpoint="completions",status="200"}'] >= 1
    assert values["specfleet_coordinator_completion_tokens_total"] >= 4
    assert values["specfleet_coordinator_acceptance_rate"] == pytest.approx(0.5)
    assert values["specfleet_coordinator_connected_drafters"] == 1
    assert values["specfleet_coordinator_verifier_connected"] == 1
    assert values["specfleet_coordinator_queue_depth"] == 0


def test_concurrent_requests_are_routed_to_their_own_clients(client: openai.OpenAI) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(n: int) -> str:
        out = client.completions.create(model="target", prompt=f"SLOW {n}", max_tokens=n)
        return out.choices[0].text

    sizes = [3, 8, 5, 12, 1, 7]
    with ThreadPoolExecutor(len(sizes)) as pool:
        texts = list(pool.map(one, sizes))
    assert texts == [expected_text(n) for n in sizes]
