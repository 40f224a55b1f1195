"""The coordinator's HTTP surface in-process (Starlette TestClient): every 4xx, auth, 503 without a
verifier, /v1/models, /health, /ready and /metrics. No verifier runs here: its URL points at a
closed port, which is exactly the "verifier down" case."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from services.coordinator.app import create_app
from services.coordinator.config import CoordinatorConfig
from services.coordinator.model_info import ModelInfo
from shared.config import from_flags
from shared.queue_memory import MemoryQueue

DOWN_URL = "ws://127.0.0.1:1/v1/frontend"  # nothing listens on port 1
LONG_TEXT = "hello world " * 100  # ~1000 tokens; the tiny target's context is 512
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def msgs(text: str = "hi") -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def model_info(tiny_models: dict[str, Path]) -> ModelInfo:
    return ModelInfo.load(str(tiny_models["target"]))


class Probe(BaseModel):
    x: int


def _client(model_info: ModelInfo, **cfg: Any) -> TestClient:
    config = from_flags(CoordinatorConfig, model=model_info.root,
                        verifier_url=DOWN_URL, node_id="coord-api-test", **cfg)
    app = create_app(config, queue=MemoryQueue(), model=model_info)

    @app.post("/test/fastapi-validation")
    async def probe(body: Probe) -> dict[str, int]:  # only to prove 422s become OpenAI 400s
        return {"x": body.x}

    return TestClient(app)


@pytest.fixture(scope="module")
def client(model_info: ModelInfo) -> Iterator[TestClient]:
    with _client(model_info) as c:
        yield c


@pytest.fixture(scope="module")
def keyed(model_info: ModelInfo) -> Iterator[TestClient]:
    with _client(model_info, api_key="sekret") as c:
        yield c


BAD: list[tuple[str, str, Any, int, str | None, str | None]] = [
    # (id, path, body, status, param, code)
    ("malformed-json", CHAT, b"{not json", 400, None, "invalid_json"),
    ("body-is-list", CHAT, [1, 2], 400, None, None),
    ("chat-missing-messages", CHAT, {"model": "target"}, 400, "messages", None),
    ("chat-empty-messages", CHAT, {"messages": []}, 400, "messages", None),
    ("chat-messages-string", CHAT, {"messages": "hi"}, 400, "messages", None),
    ("chat-bad-role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", None),
    ("chat-missing-content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages", None),
    ("chat-image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages", None),
    ("chat-content-number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages", None),
    ("comp-empty-prompt", COMP, {"prompt": ""}, 400, "prompt", None),
    ("comp-missing-prompt", COMP, {"max_tokens": 3}, 400, "prompt", None),
    ("comp-empty-list", COMP, {"prompt": []}, 400, "prompt", None),
    ("comp-list-empty-string", COMP, {"prompt": [""]}, 400, "prompt", None),
    ("comp-batched", COMP, {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("comp-prompt-number", COMP, {"prompt": 7}, 400, "prompt", None),
    ("comp-ids-outside-vocab", COMP, {"prompt": [1, 2, 99999]}, 400, "prompt", None),
    ("temperature-string", CHAT, {"messages": msgs(), "temperature": "hot"}, 400, "temperature", None),
    ("max-tokens-string", COMP, {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens", None),
    ("max-tokens-bool", COMP, {"prompt": "a", "max_tokens": True}, 400, "max_tokens", None),
    ("stream-string", COMP, {"prompt": "a", "stream": "yes"}, 400, "stream", None),
    ("stop-number", COMP, {"prompt": "a", "stop": 3}, 400, "stop", None),
    ("max-tokens-zero", COMP, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", None),
    ("max-tokens-negative", CHAT, {"messages": msgs(), "max_tokens": -1}, 400, "max_tokens", None),
    ("max-completion-tokens-zero", CHAT, {"messages": msgs(), "max_completion_tokens": 0}, 400, "max_tokens", None),
    ("max-tokens-beyond-context", COMP, {"prompt": "a", "max_tokens": 100_000}, 400, "max_tokens", None),
    ("temperature-nan", COMP, b'{"prompt": "a", "temperature": NaN}', 400, "temperature", None),
    ("temperature-high", CHAT, {"messages": msgs(), "temperature": 2.5}, 400, "temperature", None),
    ("temperature-negative", COMP, {"prompt": "a", "temperature": -0.1}, 400, "temperature", None),
    ("top-p-zero", COMP, {"prompt": "a", "top_p": 0}, 400, "top_p", None),
    ("top-p-high", CHAT, {"messages": msgs(), "top_p": 1.5}, 400, "top_p", None),
    ("top-k-negative", COMP, {"prompt": "a", "top_k": -5}, 400, "top_k", None),
    ("n-seventeen", CHAT, {"messages": msgs(), "n": 17}, 400, "n", None),
    ("n-zero", COMP, {"prompt": "a", "n": 0}, 400, "n", None),
    ("seed-huge", COMP, {"prompt": "a", "seed": 2**70}, 400, "seed", None),
    ("stop-empty-string", COMP, {"prompt": "a", "stop": ""}, 400, "stop", None),
    ("stop-too-many", COMP, {"prompt": "a", "stop": [f"s{i}" for i in range(17)]}, 400, "stop", None),
    ("stop-ids-outside-vocab", COMP, {"prompt": "a", "stop_token_ids": [100000]}, 400, "stop_token_ids", None),
    ("stream-options-without-stream", COMP, {"prompt": "a", "stream_options": {"include_usage": True}},
     400, "stream_options", None),
    ("prompt-too-long", COMP, {"prompt": LONG_TEXT}, 400, "prompt", None),
    ("chat-too-long", CHAT, {"messages": msgs(LONG_TEXT)}, 400, "messages", None),
    ("unknown-model-chat", CHAT, {"model": "gpt-9", "messages": msgs()}, 404, "model", "model_not_found"),
    ("unknown-model-comp", COMP, {"model": "gpt-9", "prompt": "a"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(client: TestClient, path: str, body: Any, status: int,
                                        param: str | None, code: str | None) -> None:
    resp = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["message"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_service_survives_bad_requests(client: TestClient) -> None:
    for _, path, body, *_ in BAD:
        client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").status_code == 200


def test_oversized_body_is_413(client: TestClient) -> None:
    resp = client.post(COMP, content=b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}')
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_fastapi_validation_errors_become_400(client: TestClient) -> None:
    resp = client.post("/test/fastapi-validation", json={"x": "not-an-int"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert resp.json()["error"]["param"] == "x"


def test_unknown_path_and_method_keep_the_error_shape(client: TestClient) -> None:
    resp = client.get("/v1/nothing-here")
    assert resp.status_code == 404 and "error" in resp.json()
    resp = client.get(CHAT)
    assert resp.status_code == 405 and "error" in resp.json()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [CHAT, COMP])
def test_valid_request_without_verifier_is_503(client: TestClient, path: str, stream: bool) -> None:
    body = {"messages": msgs(), "stream": stream} if path == CHAT else {"prompt": "hello", "stream": stream}
    resp = client.post(path, json=body)
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "1"  # it reconnects: a passing refusal
    err = resp.json()["error"]
    assert err["type"] == "service_unavailable"
    assert "verifier" in err["message"]


def test_websocket_request_without_verifier_is_refused_and_the_socket_stays_open(client: TestClient) -> None:
    with client.websocket_connect("/v1/stream") as ws:
        for _ in range(2):  # the same socket takes the retry
            ws.send_json({"kind": "completion", "prompt": "hello"})
            frame = ws.receive_json()
            assert frame["type"] == "error" and frame["error"]["code"] == "service_unavailable"
            assert frame["retry_after"] == 1


@pytest.mark.parametrize(("headers", "status"), [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 401),
    ({"Authorization": "sekret"}, 401),
    ({"Authorization": "Bearer sekret"}, 503),  # accepted; then no verifier
])
def test_api_key(keyed: TestClient, headers: dict[str, str], status: int) -> None:
    resp = keyed.post(COMP, json={"prompt": "hello"}, headers=headers)
    assert resp.status_code == status
    if status == 401:
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert keyed.get("/v1/models", headers=headers).status_code == 401


def test_api_key_spares_probes(keyed: TestClient) -> None:
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/metrics").status_code == 200
    assert keyed.get("/ready").status_code == 503


def test_websocket_rejects_a_wrong_key(keyed: TestClient) -> None:
    with keyed.websocket_connect("/v1/stream") as ws:
        frame = ws.receive_json()
        assert frame["type"] == "error" and frame["error"]["code"] == "invalid_api_key"


def test_models(client: TestClient, model_info: ModelInfo) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "target"
    assert card["object"] == "model" and card["owned_by"] == "specfleet" and card["parent"] is None
    assert card["root"] == model_info.root and Path(card["root"]).is_absolute()
    assert card["max_model_len"] == 512
    assert isinstance(card["created"], int)


def test_served_model_name(model_info: ModelInfo) -> None:
    cfg = from_flags(CoordinatorConfig, model=model_info.root, verifier_url=DOWN_URL, served_model_name="tiny")
    with TestClient(create_app(cfg, queue=MemoryQueue())) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert c.post(COMP, json={"model": "target", "prompt": "a"}).status_code == 404
        assert c.post(COMP, json={"model": "tiny", "prompt": "a"}).status_code == 503


def test_ready_says_what_is_missing(client: TestClient) -> None:
    resp = client.get("/ready")
    assert resp.status_code == 503
    body = resp.json()
    assert body["status"] == "not_ready" and body["verifier_connected"] is False
    assert "verifier link is down" in body["missing"][0]


def test_metrics_count_requests_by_endpoint_and_status(client: TestClient) -> None:
    assert client.post(CHAT, json={"messages": []}).status_code == 400
    assert client.post(COMP, json={"prompt": ""}).status_code == 400  # n > 1 is served now: not a 400
    text = client.get("/metrics").text
    assert 'specfleet_coordinator_requests_total{endpoint="chat",status="400"}' in text
    assert 'specfleet_coordinator_requests_total{endpoint="completions",status="400"}' in text
    for name in ("request_latency_seconds_bucket", "prompt_tokens_total", "completion_tokens_total",
                 "drafted_tokens_total", "accepted_tokens_total", "acceptance_rate", "queue_depth",
                 "connected_drafters"):
        assert f"specfleet_coordinator_{name}" in text
    assert "specfleet_coordinator_verifier_connected 0.0" in text
    assert "process_cpu_seconds_total" in text  # the process's CPU, as the verifier and drafters report it


def test_missing_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    from shared.models import ModelLoadError

    with pytest.raises(ModelLoadError, match="--model"):
        create_app(from_flags(CoordinatorConfig, model=""))
    with pytest.raises(ModelLoadError, match="does not exist"):
        create_app(from_flags(CoordinatorConfig, model=str(tmp_path / "nope")))
