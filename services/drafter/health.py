"""The drafter's HTTP side: Prometheus ``/metrics`` plus ``/health`` and ``/ready`` for probes.

Served on ``--metrics-port`` from a background thread, so a scrape never waits for the event loop.

``/health``  200 while the event loop is alive: a task on it stamps a heartbeat every second, and
             a stamp older than ``stale_s`` (the loop is stuck) answers 503. Liveness probes.
``/ready``   200 while the drafter holds a live link to the verifier, else 503. Readiness probes.
``/metrics`` the drafter's Prometheus registry.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from shared.log import get_logger

log = get_logger("drafter.health")


class HealthServer:
    """/metrics, /health and /ready on one port; ``connected`` says whether the verifier link is up."""

    def __init__(self, registry: CollectorRegistry, connected: Callable[[], bool], stale_s: float = 60.0) -> None:
        self.registry = registry
        self.connected = connected
        self.stale_s = stale_s
        self.heartbeat = time.monotonic()
        self._server: ThreadingHTTPServer | None = None
        self._beat: asyncio.Task[None] | None = None

    def status(self) -> tuple[int, int, dict[str, object]]:
        """(health code, ready code, body) as the endpoints answer them now."""
        age = time.monotonic() - self.heartbeat
        alive = age < self.stale_s
        linked = bool(self.connected())
        body: dict[str, object] = {"alive": alive, "loop_heartbeat_age_s": round(age, 3), "verifier_connected": linked}
        return (200 if alive else 503), (200 if alive and linked else 503), body

    def start(self, host: str, port: int) -> int:
        """Serve on a background thread and start the heartbeat task; returns the bound port."""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, generate_latest(owner.registry), CONTENT_TYPE_LATEST)
                elif path in ("/health", "/ready"):
                    health, ready, body = owner.status()
                    code = health if path == "/health" else ready
                    self._reply(code, json.dumps(body).encode() + b"\n", "application/json")
                else:
                    self._reply(404, b"use /metrics, /health or /ready\n", "text/plain")

            def _reply(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: no access log
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="drafter-http", daemon=True).start()
        self._beat = asyncio.get_running_loop().create_task(self._heartbeat(), name="drafter-heartbeat")
        bound = int(self._server.server_address[1])
        log.info("metrics and health served", host=host, port=bound, paths="/metrics /health /ready")
        return bound

    async def _heartbeat(self) -> None:
        period = min(1.0, self.stale_s / 4)  # a beat well within stale_s, so only a stuck loop reads as stale
        while True:
            self.heartbeat = time.monotonic()
            await asyncio.sleep(period)

    def close(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
