"""The fleet as one coordinator sees it: what ``GET /v1/fleet``, the dashboard and ``specfleet status`` show.

``FleetMonitor.run`` reads every verifier's ``GET /fleet`` (its engine, KV memory, cumulative
counts and one row per drafter) once a second, beside this coordinator's own counts (requests in
flight, queued, refused with 429; recent TTFT and TPOT). Rates are differences of cumulative counts
over the last ``RATE_WINDOW_S`` seconds, so a slow read never makes a spike. The last
``HISTORY_S`` seconds of readings are kept for the dashboard's charts.

The estimated speedup over target-only decoding, per verifier over the rate window:

    τ  = tokens committed / decode segments   (tokens a session gains per forward it decodes in)
    T  = mean step time;  N, B = decode tokens and decode sessions a step fed (prefill left out:
         target-only decoding pays it too)
    T0 = T − a·(N − B)                        (the same steps fed one token per session)
    speedup ≈ τ · T0 / T

``a`` is the verifier's fitted seconds per fed token (its step-time estimator). The estimate leaves
out the attention term and the drafters' own time, which the edge pays; the benchmarks measure the
real ratio side by side. Under ``--backend vllm`` there are no step times and it is τ alone, right
only for a memory-bound verifier.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from shared.log import get_logger

if TYPE_CHECKING:
    from services.coordinator.state import CoordinatorState

log = get_logger("coordinator.fleet")
SAMPLE_EVERY_S = 1.0
HISTORY_S = 600.0
RATE_WINDOW_S = 5.0
READ_TIMEOUT_S = 1.5
SPEEDUP_METHOD = ("τ·T0/T: tokens committed per decoding session-step τ, times the verifier's fitted cost of the "
                  "same steps fed one token per session (T0) over their measured cost (T); excludes drafting time")


def http_url(verifier_url: str, path: str) -> str:
    """``ws://host:port/...`` -> ``http://host:port{path}`` (``wss`` -> ``https``)."""
    parts = urlsplit(verifier_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, path, "", ""))


@dataclass
class VerifierReadings:
    """One verifier's recent ``/fleet`` readings (newest last) and why the last read failed."""

    url: str
    readings: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=int(RATE_WINDOW_S) + 2))
    error: str = "not read yet"

    @property
    def latest(self) -> dict[str, Any] | None:
        return self.readings[-1] if self.readings and not self.error else None

    def base(self) -> dict[str, Any] | None:
        """The oldest reading of the window from the same verifier process (a restart resets counts)."""
        latest = self.latest
        if latest is None:
            return None
        for old in self.readings:
            if old["instance"] == latest["instance"] and old is not latest:
                return old
        return None


def _rates(now: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """The verifier's rates between two readings (empty when there is no earlier one)."""
    if then is None or now["time"] <= then["time"]:
        return {}
    dt = now["time"] - then["time"]
    d = {k: now["totals"][k] - then["totals"].get(k, 0.0) for k in now["totals"]}
    steps, segments = d["steps"], d["decode_segments"]
    out: dict[str, Any] = {"tokens_s": d["generated"] / dt, "generated": d["generated"]}
    if segments > 0:
        out["tokens_per_forward"] = d["generated"] / segments
        out["batch_sessions"] = segments / steps if steps else None
    if steps > 0 and d["step_seconds"] > 0:
        step, fed, sessions = d["step_seconds"] / steps, d["decode_tokens"] / steps, segments / steps
        per_token = (now.get("estimator") or {}).get("sum_new", 0.0)
        target_only = max(step - per_token * (fed - sessions), 0.05 * step)
        out["step_ms"] = 1000 * step
        out["speedup"] = out.get("tokens_per_forward", 1.0) * target_only / step
    elif "tokens_per_forward" in out:
        out["speedup"] = out["tokens_per_forward"]
    return out


def _drafter_rows(url: str, now: dict[str, Any], then: dict[str, Any] | None) -> list[dict[str, Any]]:
    before = {d["node"]: d for d in then["drafters"]} if then else {}
    dt = now["time"] - then["time"] if then else 0.0
    rows = []
    for d in now["drafters"]:
        old = before.get(d["node"])
        if old is None and then is not None and d["connected_since"] >= then["time"]:
            # connected within the window: the verifier counts a connection's tokens from zero
            old = {"drafted_tokens": 0.0, "accepted_tokens": 0.0}
        drafted = d["drafted_tokens"] - old["drafted_tokens"] if old else 0.0
        accepted = d["accepted_tokens"] - old["accepted_tokens"] if old else 0.0
        rows.append({
            "verifier": url, "node": d["node"], "model": d["model"], "sessions": d["sessions"],
            "acceptance": accepted / drafted if drafted > 0 else d["alpha"],
            "drafted_tokens_s": drafted / dt if dt > 0 else 0.0,
            "rtt_ms": 1000 * d["rtt_s"] if d["rtt_s"] is not None else None,
            "budget": d["budget"], "trusted": d["trusted"], "connected_since": d["connected_since"],
        })
    return rows


def _verifier_row(v: VerifierReadings, rates: dict[str, Any]) -> dict[str, Any]:
    latest = v.latest
    if latest is None:
        return {"url": v.url, "up": False, "error": v.error}
    kv = latest["kv"]
    if kv is not None:
        kv = {**kv, "free_bytes": max(kv["budget_bytes"] - kv["reserved_bytes"], 0)}
    return {"url": v.url, "up": True, "error": "", "ready": latest["ready"], "engine": latest["engine"],
            "policies": latest["policies"], "kv": kv, "sessions": latest["sessions"],
            "step_ms": rates.get("step_ms"), "batch_sessions": rates.get("batch_sessions"),
            "tokens_s": rates.get("tokens_s", 0.0), "tokens_per_forward": rates.get("tokens_per_forward")}


class FleetMonitor:
    """Reads the verifiers once a second and keeps ``HISTORY_S`` seconds of the fleet's numbers."""

    def __init__(self, state: CoordinatorState, urls: list[str], token: str = "",
                 tls: ssl.SSLContext | None = None) -> None:
        self.state = state
        self.verifiers = [VerifierReadings(u) for u in urls]
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._tls = tls
        self.history: deque[dict[str, Any]] = deque(maxlen=int(HISTORY_S / SAMPLE_EVERY_S))
        self.queued: int | None = None

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=READ_TIMEOUT_S, verify=self._tls or True) as client:
            while True:
                started = time.monotonic()
                with contextlib.suppress(Exception):  # never let one bad reading end the loop
                    await self.sample(client)
                await asyncio.sleep(max(SAMPLE_EVERY_S - (time.monotonic() - started), 0.05))

    async def sample(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self._read(client, v) for v in self.verifiers), self._read_queue())
        view = self.view(history=False)
        point = {"t": view["time"], "tokens_s": view["speed"]["tokens_s"], "queue": view["requests"]["queued"],
                 "in_flight": view["requests"]["in_flight"],
                 "acceptance": {d["node"]: d["acceptance"] for d in view["drafters"] if d["acceptance"] is not None}}
        self.history.append(point)

    async def _read(self, client: httpx.AsyncClient, v: VerifierReadings) -> None:
        try:
            resp = await client.get(http_url(v.url, "/fleet"), headers=self._headers)
            if resp.status_code != 200:
                v.error = f"GET /fleet answered {resp.status_code}: {resp.text.strip()[:200]}"
                return
            v.readings.append(resp.json())
            v.error = ""
        except (httpx.HTTPError, ValueError) as exc:
            v.error = f"cannot read {http_url(v.url, '/fleet')}: {exc!r}"

    async def _read_queue(self) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                self.queued = await self.state.queue.depth()
        except Exception:  # an unreachable queue shows as unknown, never breaks the view
            self.queued = None

    def view(self, since: float | None = None, history: bool = True) -> dict[str, Any]:
        """The fleet now, as ``GET /v1/fleet`` returns it (history: points newer than ``since``)."""
        verifiers, drafters, weighted, generated = [], [], 0.0, 0.0
        tokens_s, tokens_per_forward = 0.0, []
        for v in self.verifiers:
            latest, base = v.latest, v.base()
            rates = _rates(latest, base) if latest is not None else {}
            verifiers.append(_verifier_row(v, rates))
            if latest is not None:
                drafters += _drafter_rows(v.url, latest, base)
            tokens_s += rates.get("tokens_s", 0.0)
            if "speedup" in rates and rates["generated"] > 0:
                weighted += rates["speedup"] * rates["generated"]
                generated += rates["generated"]
                tokens_per_forward.append(rates["tokens_per_forward"])
        return {
            "time": time.time(), "coordinator": self.state.node_id, **self._readiness(),
            "verifiers": verifiers, "drafters": drafters,
            "requests": {"in_flight": self.state.generator.admission.in_flight, "queued": self.queued,
                         "rejected_429": self.state.metrics.rejected},
            "speed": self._speed(tokens_s, tokens_per_forward, weighted / generated if generated else None),
            "history_s": HISTORY_S,
            "history": [p for p in self.history if since is None or p["t"] > since] if history else [],
        }

    def _readiness(self) -> dict[str, Any]:
        missing = self.state.missing()
        return {"status": "ready" if not missing else "not_ready", "missing": missing}

    def _speed(self, tokens_s: float, per_forward: list[float], speedup: float | None) -> dict[str, Any]:
        m = self.state.metrics
        return {"tokens_s": tokens_s,
                "ttft_p50_s": m.recent_ttft.percentile(0.5), "ttft_p99_s": m.recent_ttft.percentile(0.99),
                "tpot_p50_s": m.recent_tpot.percentile(0.5), "tpot_p99_s": m.recent_tpot.percentile(0.99),
                "tokens_per_forward": sum(per_forward) / len(per_forward) if per_forward else None,
                "speedup_estimate": speedup, "speedup_method": SPEEDUP_METHOD}
