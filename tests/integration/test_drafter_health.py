"""The drafter's probe endpoints: /health follows the event loop, /ready the verifier link."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from services.drafter.health import HealthServer
from services.drafter.metrics import DrafterMetrics


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.asyncio
async def test_health_ready_and_metrics() -> None:
    metrics = DrafterMetrics()
    linked = {"up": False}
    server = HealthServer(metrics.registry, lambda: linked["up"], stale_s=0.5)
    port = server.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    try:
        code, body = await asyncio.to_thread(_get, base + "/health")
        assert code == 200 and json.loads(body)["alive"] is True
        code, body = await asyncio.to_thread(_get, base + "/ready")
        assert code == 503 and json.loads(body)["verifier_connected"] is False
        linked["up"] = True
        assert (await asyncio.to_thread(_get, base + "/ready"))[0] == 200
        metrics.rounds.inc()
        code, body = await asyncio.to_thread(_get, base + "/metrics")
        assert code == 200 and b"specfleet_drafter_rounds_total 1.0" in body
        assert (await asyncio.to_thread(_get, base + "/nope"))[0] == 404
        # A stuck event loop: the heartbeat task cannot run, so liveness and readiness fail.
        time.sleep(0.8)
        assert _get(base + "/health")[0] == 503
        assert _get(base + "/ready")[0] == 503
        await asyncio.sleep(1.2)  # the loop runs again: the heartbeat catches up
        assert (await asyncio.to_thread(_get, base + "/health"))[0] == 200
    finally:
        server.close()
