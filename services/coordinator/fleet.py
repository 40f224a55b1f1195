"""The fleet as one coordinator sees it: what ``GET /v1/fleet``, the dashboard and ``specfleet status`` show.

``FleetMonitor.run`` reads every verifier's ``GET /fleet`` (its engine, KV memory, cumulative
counts and one row per drafter) once a second, beside this coordinator's own counts (requests in
flight, queued, refused with 429; recent TTFT and TPOT). Rates are differences of cumulative counts
over the last ``RATE_WINDOW_S`` seconds, so a slow read never makes a spike. The last
``HISTORY_S`` seconds of readings are kept for the dashboard's charts.

The estimated speedup over target-only decoding, per verifier over the rate window, compares the
tokens the fleet served with what the verifier alone would serve the same requests:

    C  = requests in flight, averaged over the seconds the rates span (each one session of a
         target-only step)
    L  = the mean context of a decoding session in the window's steps
    T0 = the verifier's cost of a target-only step of C sessions after L cached rows: the forward
         feeding each one token (measured at its start-up and whenever it runs one, a line in L per
         session count, interpolated in C: ``shared.target_only_cost``) plus its busy time between
         forwards (a line in the sessions, ``between_forwards``: the measured guard's price too)
    speedup ≈ (tokens/s served) · T0 / C      (target-only serves C tokens a T0)

The tokens served come from the clock, so the drafters' time, the network and a session waiting
for its drafts count in the ratio (an earlier form, τ·T0/T from the measured step T, left them
out and overstated it: ``bench edge-drafts`` records the estimate beside the measured ratio). The
busy time between forwards is measured in the regime the verifier runs: a speculating verifier's
stands in for target-only's. Under ``--backend vllm`` nothing prices a target-only step and it is
τ alone (tokens committed per decode segment), right only for a memory-bound verifier with drafts
that are always on time.
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
from shared.target_only_cost import forward_seconds

if TYPE_CHECKING:
    from services.coordinator.state import CoordinatorState

log = get_logger("coordinator.fleet")
SAMPLE_EVERY_S = 1.0
HISTORY_S = 600.0
RATE_WINDOW_S = 5.0
WINDOW_SLACK_S = 0.5  # a reading taken late by up to this still opens the window
READ_TIMEOUT_S = 1.5
SPEEDUP_METHOD = ("tokens/s served over what target-only would serve the same requests: C in flight, one token "
                  "each per step, priced by the verifier's measured target-only forwards and its busy time between "
                  "forwards (drafting and network time count)")
SPEEDUP_METHOD_TAU = ("tokens committed per decode segment (τ; --backend vllm has no step times to price a "
                      "target-only step; right only when the verifier is memory-bound and drafts are on time)")


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
        """The oldest reading at most ``RATE_WINDOW_S`` before the latest, from the same verifier
        process (a restart resets counts). Not simply the oldest kept: the deque holds a little more
        than the window, and rates over a longer span than the requests in flight are averaged over
        would read low as a load starts (measured: 1.54x shown where 1.83x was served)."""
        latest = self.latest
        if latest is None:
            return None
        for old in self.readings:
            if (old["instance"] == latest["instance"] and old is not latest
                    and latest["time"] - old["time"] <= RATE_WINDOW_S + WINDOW_SLACK_S):
                return old
        return None


def _rates(now: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """The verifier's rates between two readings (empty when there is no earlier one)."""
    if then is None or now["time"] <= then["time"]:
        return {}
    dt = now["time"] - then["time"]
    d = {k: now["totals"][k] - then["totals"].get(k, 0.0) for k in now["totals"]}
    steps, segments = d["steps"], d["decode_segments"]
    out: dict[str, Any] = {"tokens_s": d["generated"] / dt, "generated": d["generated"], "seconds": dt}
    if segments > 0:
        out["tokens_per_forward"] = d["generated"] / segments
        out["batch_sessions"] = segments / steps if steps else None
    if steps > 0 and d["step_seconds"] > 0:  # specfleet's own engine (vLLM runs its own steps, untimed here)
        out["step_ms"] = 1000 * d["step_seconds"] / steps
    cost = now.get("target_only")
    if "step_ms" in out and segments > 0 and "decode_cached" in d and cost:
        out["context"] = d["decode_cached"] / segments  # L: a decoding session's mean cached rows
        out["target_only"] = cost
        if now.get("between_forwards"):
            out["between_forwards"] = now["between_forwards"]
    return out


def target_only_speedup(rates: dict[str, Any], in_flight: float) -> float | None:
    """The fleet's tokens/s over what target-only would serve the same ``in_flight`` requests
    (see the module): ``tokens_s · T0(C) / C``. τ where the verifier prices no target-only step
    (vLLM); None with nothing decoded in the window."""
    if "target_only" not in rates:
        return rates.get("tokens_per_forward")
    sessions = max(in_flight, 1.0)
    seconds = forward_seconds(rates["target_only"], sessions, rates["context"])
    if seconds is None:
        return None
    at_zero, per_session = rates.get("between_forwards") or (0.0, 0.0)
    return rates["tokens_s"] * (seconds + at_zero + per_session * sessions) / sessions


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
        verifiers: list[dict[str, Any]] = []
        drafters: list[dict[str, Any]] = []
        per_verifier: list[dict[str, Any]] = []
        tokens_s, tokens_per_forward, tau_only = 0.0, [], False
        for v in self.verifiers:
            latest, base = v.latest, v.base()
            rates = _rates(latest, base) if latest is not None else {}
            verifiers.append(_verifier_row(v, rates))
            if latest is not None:
                drafters += _drafter_rows(v.url, latest, base)
            tokens_s += rates.get("tokens_s", 0.0)
            if "tokens_per_forward" in rates and rates["generated"] > 0:
                tau_only = tau_only or "target_only" not in rates
                per_verifier.append(rates)
                tokens_per_forward.append(rates["tokens_per_forward"])
        speedup = self._speedup(per_verifier)
        return {
            "time": time.time(), "coordinator": self.state.node_id, **self._readiness(),
            "verifiers": verifiers, "drafters": drafters,
            "requests": {"in_flight": self.state.generator.admission.in_flight, "queued": self.queued,
                         "rejected_429": self.state.metrics.rejected},
            "speed": self._speed(tokens_s, tokens_per_forward, speedup,
                                 SPEEDUP_METHOD_TAU if tau_only else SPEEDUP_METHOD),
            "history_s": HISTORY_S,
            "history": [p for p in self.history if since is None or p["t"] > since] if history else [],
        }

    def _readiness(self) -> dict[str, Any]:
        missing = self.state.missing()
        return {"status": "ready" if not missing else "not_ready", "missing": missing}

    def _speedup(self, per_verifier: list[dict[str, Any]]) -> float | None:
        """The verifiers' speedups weighted by tokens; each prices its share of the requests in flight
        (averaged from the history over the span the rates cover, the newest count included)."""
        generated = sum(r["generated"] for r in per_verifier)
        if not generated:
            return None
        cut = time.time() - max(r["seconds"] for r in per_verifier)
        counts = [p["in_flight"] for p in self.history if p["t"] >= cut]
        counts.append(self.state.generator.admission.in_flight)
        in_flight = sum(counts) / len(counts)
        shares = [(r, r["generated"] / generated) for r in per_verifier]
        values = [(target_only_speedup(r, in_flight * share), share) for r, share in shares]
        return sum(v * share for v, share in values if v is not None) or None

    def _speed(self, tokens_s: float, per_forward: list[float], speedup: float | None,
               method: str) -> dict[str, Any]:
        m = self.state.metrics
        return {"tokens_s": tokens_s,
                "ttft_p50_s": m.recent_ttft.percentile(0.5), "ttft_p99_s": m.recent_ttft.percentile(0.99),
                "tpot_p50_s": m.recent_tpot.percentile(0.5), "tpot_p99_s": m.recent_tpot.percentile(0.99),
                "tokens_per_forward": sum(per_forward) / len(per_forward) if per_forward else None,
                "speedup_estimate": speedup, "speedup_method": method}
