"""Rate limits and token quotas per API key: 429 with Retry-After in the OpenAI error shape.

The coordinator app runs in-process (lifespan included) against the fake verifier of the
coordinator tests; requests go through its real routes, admission and WebSocket handler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from services.coordinator.config import CoordinatorConfig, check_config
from services.coordinator.model_info import ModelInfo
from services.coordinator.ratelimit import RateLimiter
from shared.config import ConfigError, from_flags, load_config
from tests.integration.coordinator_fakes import RawWebSocket, in_process

KEYS = "key-alice,key-bob"
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> ModelInfo:
    return ModelInfo.load(str(tiny_models["target"]))


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def body(max_tokens: int = 4) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": max_tokens}


def assert_429(resp: httpx.Response, code: str, retry_after: int, hint: str) -> None:
    assert resp.status_code == 429, resp.text
    assert resp.headers["Retry-After"] == str(retry_after)
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert hint in error["message"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.asyncio
async def test_request_rate_per_key(model: ModelInfo) -> None:
    async with in_process(model, api_keys=KEYS, rate_limit_rps=0.5, rate_limit_burst=2) as h:
        clock = Clock()
        h.state.limiter = RateLimiter(0.5, 2, clock=clock)
        for _ in range(2):  # the burst
            assert (await h.http.post(COMP, json=body(), headers=auth("key-alice"))).status_code == 200
        assert_429(await h.http.post(COMP, json=body(), headers=auth("key-alice")), "rate_limit_exceeded", 2,
                   "--rate-limit-rps")
        # bob has his own bucket; a wrong key is 401 and spends nobody's
        assert (await h.http.post(COMP, json=body(), headers=auth("key-bob"))).status_code == 200
        assert (await h.http.post(COMP, json=body(), headers=auth("key-mallory"))).status_code == 401
        clock.now += 2.0  # one request's worth refilled
        assert (await h.http.post(COMP, json=body(), headers=auth("key-alice"))).status_code == 200
        assert (await h.http.post(COMP, json=body(), headers=auth("key-alice"))).status_code == 429
        async with RawWebSocket(h.app, headers=[(b"authorization", b"Bearer key-alice")]) as ws:
            _, frame = await ws.run({"kind": "completion", **body()})
            assert frame["type"] == "error" and frame["error"]["code"] == "rate_limit_exceeded", frame
            assert frame["retry_after"] == 2, frame
        assert await h.metric('specfleet_coordinator_requests_total{endpoint="completions",status="429"}') == 2


@pytest.mark.asyncio
async def test_token_quota_per_key(model: ModelInfo) -> None:
    async with in_process(model, api_keys=KEYS, token_quota=10, quota_window_s=60) as h:
        clock = Clock()
        h.state.limiter = RateLimiter(token_quota=10, quota_window_s=60, clock=clock)
        assert (await h.http.post(COMP, json=body(6), headers=auth("key-alice"))).status_code == 200
        assert_429(await h.http.post(COMP, json=body(6), headers=auth("key-alice")), "insufficient_quota", 60,
                   "4 left")
        assert (await h.http.post(COMP, json=body(4), headers=auth("key-alice"))).status_code == 200
        assert (await h.http.post(COMP, json=body(1), headers=auth("key-alice"))).status_code == 429
        assert (await h.http.post(COMP, json=body(10), headers=auth("key-bob"))).status_code == 200
        bad = await h.http.post(COMP, json={"prompt": "x", "max_tokens": "many"}, headers=auth("key-bob"))
        assert bad.status_code == 400  # refused while parsing: charges nothing
        clock.now += 61  # a new window
        assert (await h.http.post(COMP, json=body(10), headers=auth("key-alice"))).status_code == 200


def test_limits_are_configurable_and_checked() -> None:
    cfg = load_config(CoordinatorConfig, ["--rate-limit-rps", "5", "--token-quota", "1000"],
                      env={"SPECFLEET_RATE_LIMIT_BURST": "10", "SPECFLEET_API_KEYS": "a,b"})
    c = cfg.clients
    assert (c.rate_limit_rps, c.rate_limit_burst, c.token_quota, c.api_keys) == (5.0, 10, 1000, "a,b")
    with pytest.raises(ConfigError, match="--quota-window-s"):
        check_config(from_flags(CoordinatorConfig, quota_window_s=0))
