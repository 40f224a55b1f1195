"""``GET /v1/fleet`` and ``GET /dashboard`` in-process: credentials, assets, and the states a
broken fleet shows (its verifier's URL points at a closed port: "verifier down")."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from services.coordinator.app import create_app
from services.coordinator.config import CoordinatorConfig
from services.coordinator.model_info import ModelInfo
from shared.config import from_flags
from shared.queue_memory import MemoryQueue

DOWN_URL = "ws://127.0.0.1:1/v1/frontend"
KEY = "sekret"
BEARER = {"Authorization": f"Bearer {KEY}"}


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture(scope="module")
def keyed(tiny_models: dict[str, Path]) -> Iterator[TestClient]:
    model = ModelInfo.load(str(tiny_models["target"]))
    cfg = from_flags(CoordinatorConfig, model=model.root, verifier_url=DOWN_URL, node_id="fleet-test", api_key=KEY)
    with TestClient(create_app(cfg, queue=MemoryQueue(), model=model)) as client:
        yield client


@pytest.mark.parametrize("path", ["/v1/fleet", "/dashboard", "/dashboard/dashboard.js"])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, basic("ops", "wrong"),
                                     {"Authorization": "Basic %%%"}], ids=["none", "bad-bearer", "bad-basic", "junk"])
def test_every_view_needs_the_api_key(keyed: TestClient, path: str, headers: dict[str, str]) -> None:
    resp = keyed.get(path, headers=headers)
    assert resp.status_code == 401
    if path.startswith("/dashboard"):  # a browser is asked for the key
        assert resp.headers["www-authenticate"].startswith('Basic realm="specfleet"')
    else:
        assert resp.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers", [BEARER, basic("ops", KEY), basic("", KEY)], ids=["bearer", "basic", "no-user"])
def test_the_page_and_its_assets_with_the_key(keyed: TestClient, headers: dict[str, str]) -> None:
    page = keyed.get("/dashboard", headers=headers)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "<title>specfleet · target</title>" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere: works offline
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        asset = keyed.get(f"/dashboard/{name}", headers=headers)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
    assert keyed.get("/dashboard/../app.py", headers=headers).status_code == 404
    assert keyed.get("/dashboard/secrets.env", headers=headers).status_code == 404


def test_fleet_with_its_verifier_down(keyed: TestClient) -> None:
    view: dict[str, Any] = keyed.get("/v1/fleet", headers=BEARER).json()
    assert view["status"] == "not_ready"
    assert any("verifier link is down" in m for m in view["missing"])
    [verifier] = view["verifiers"]
    assert verifier["url"] == DOWN_URL and verifier["up"] is False and verifier["error"]
    assert view["drafters"] == []
    assert view["requests"] == {"in_flight": 0, "queued": 0, "rejected_429": 0}
    assert view["speed"]["tokens_s"] == 0.0 and view["speed"]["speedup_estimate"] is None
    assert view["history_s"] == 600


@pytest.mark.asyncio
async def test_history_grows_and_since_filters(keyed: TestClient) -> None:
    monitor = keyed.app.state.coordinator.fleet  # type: ignore[attr-defined]
    async with httpx.AsyncClient() as client:
        for _ in range(3):
            await monitor.sample(client)
    unreachable = monitor.verifiers[0].error
    assert unreachable.startswith("cannot read http://127.0.0.1:1/fleet")
    points = keyed.get("/v1/fleet", headers=BEARER).json()["history"]
    assert len(points) >= 3 and all(p["tokens_s"] == 0.0 and p["queue"] == 0 for p in points)
    later = keyed.get("/v1/fleet", params={"since": points[-2]["t"]}, headers=BEARER).json()["history"]
    assert later and all(p["t"] > points[-2]["t"] for p in later)
    assert keyed.get("/v1/fleet", params={"since": "soon"}, headers=BEARER).status_code == 400


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                              ("GET", "/v1/models")])
def test_the_api_takes_no_browser_login(keyed: TestClient, method: str, path: str) -> None:
    """Basic is for the read-only views: a cached dashboard login cannot send requests for another site."""
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    resp = keyed.request(method, path, headers=basic("ops", KEY), json=body if method == "POST" else None)
    assert resp.status_code == 401


def test_a_load_that_just_started_reads_what_it_serves(keyed: TestClient) -> None:
    """The tokens' window and the requests' in flight span the same seconds: a rate over the idle
    second before a load started would show 0.83 of the speedup served (1.54x read where 1.83x
    was measured, 2026-12-05)."""
    from services.coordinator.fleet import FleetMonitor, VerifierReadings
    from tests.unit.test_fleet_view import COST, reading

    monitor = FleetMonitor(keyed.app.state.coordinator, [])  # type: ignore[attr-defined]
    v = VerifierReadings("ws://v")
    monitor.verifiers, v.error = [v], ""
    now, began = time.time(), time.time() - 5.0
    for t in (now - 7 + i for i in range(8)):  # one reading a second; target-only decoding from `began`
        done = max(t - began, 0.0) / 0.018  # one token a T0(1) = 17 ms + 100 rows · 10 µs
        read = reading(t, steps=done, decode_segments=done, decode_tokens=done, decode_cached=100 * done,
                       step_seconds=0.018 * done, generated=done, cost=COST)
        v.readings.append({**read, "kv": None, "ready": True, "engine": {}, "policies": {}, "sessions": 1})
        monitor.history.append({"t": t, "in_flight": 1 if t >= began else 0})
    assert monitor.view(history=False)["speed"]["speedup_estimate"] == pytest.approx(1.0)
