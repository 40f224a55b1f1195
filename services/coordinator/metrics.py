"""Prometheus metrics of one coordinator, in a registry of its own.

A per-app CollectorRegistry (not prometheus_client's global one) lets several coordinators live
in one process, as they do in tests, without "duplicated timeseries" errors. Gauges that mirror
someone else's state (queue depth, connected drafters) are refreshed at scrape time.
"""

from __future__ import annotations

import math
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shared.protocol import TokenEvent

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: relaying one event is normally tens of microseconds; the top buckets catch a stalled loop or client
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_RELAY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_PREFIX = "specfleet_coordinator"
#: the dashboard's latency percentiles cover requests of the last this many seconds
RECENT_S = 300.0


class RecentSamples:
    """Values observed in the last ``RECENT_S`` seconds, for exact percentiles (the dashboard's
    TTFT and TPOT p50/p99; Prometheus computes its own from the histograms)."""

    def __init__(self, window_s: float = RECENT_S, most: int = 20_000) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque(maxlen=most)

    def add(self, value: float, now: float | None = None) -> None:
        self._items.append((time.monotonic() if now is None else now, value))

    def percentile(self, q: float, now: float | None = None) -> float | None:
        """The ``q`` quantile (0..1, nearest rank) of the recent values; None when there are none."""
        cut = (time.monotonic() if now is None else now) - self.window_s
        while self._items and self._items[0][0] < cut:
            self._items.popleft()
        if not self._items:
            return None
        values = sorted(v for _, v in self._items)
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


class RequestTimer:
    """Counts and times one request exactly once, whenever and wherever it ends: for a stream
    that is long after the handler returned."""

    def __init__(self, metrics: CoordinatorMetrics, endpoint: str) -> None:
        self._metrics = metrics
        self._endpoint = endpoint
        self._start = time.perf_counter()
        self._done = False

    def finish(self, status: int) -> None:
        if self._done:
            return
        self._done = True
        self._metrics.requests.labels(self._endpoint, str(status)).inc()
        if status == 429:
            self._metrics.rejected += 1
        self._metrics.latency.labels(self._endpoint).observe(time.perf_counter() - self._start)


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, memory: the process's (all its coordinators')
        self.requests = Counter(f"{_PREFIX}_requests", "Requests by endpoint and final HTTP status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram(f"{_PREFIX}_request_latency_seconds", "Time from arrival to the last byte",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(f"{_PREFIX}_time_to_first_token_seconds", "Time from queueing to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{_PREFIX}_time_per_output_token_seconds", "A finished request's time from its first "
                              "token to its last, over its tokens after the first", buckets=_TPOT_BUCKETS, registry=r)
        self.recent_ttft = RecentSamples()
        self.recent_tpot = RecentSamples()
        self.rejected = 0  # requests answered 429 (rate limit, in-flight cap, full queue)
        self.prompt_tokens = Counter(f"{_PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter(f"{_PREFIX}_completion_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.drafted_tokens = Counter(f"{_PREFIX}_drafted_tokens", "Draft tokens proposed for finished requests",
                                      registry=r)
        self.accepted_tokens = Counter(f"{_PREFIX}_accepted_tokens", "Draft tokens the verifier accepted",
                                       registry=r)
        self.acceptance_rate = Gauge(f"{_PREFIX}_acceptance_rate", "accepted / drafted tokens since start",
                                     registry=r)
        self.queue_fallback = Counter(f"{_PREFIX}_queue_fallback", "Queued requests started target-only because "
                                      "no drafter was connected (--queue-fallback-s) or none had room "
                                      "(--queue-wait-s)", registry=r)
        self.routed = Counter(f"{_PREFIX}_routed", "New requests by where they went: 'drafter' (queued for one) or "
                              "'target_only' (opened on the verifier: --speculation off, or auto with no drafter "
                              "or with the verifier's policy wanting no drafts)", ["path"], registry=r)
        self.queue_depth = Gauge(f"{_PREFIX}_queue_depth", "Requests waiting for a drafter", registry=r)
        self.drafters = Gauge(f"{_PREFIX}_connected_drafters", "Drafters in the verifier's latest FleetStatus",
                              registry=r)
        self.verifier_up = Gauge(f"{_PREFIX}_verifier_connected", "1 while the verifier link is up", registry=r)
        self.in_flight = Gauge(f"{_PREFIX}_requests_in_flight",
                               "Admitted requests (being read, queued or generating); capped by --max-in-flight",
                               registry=r)
        self.in_flight_limit = Gauge(f"{_PREFIX}_max_in_flight", "The in-flight cap (0: none)", registry=r)
        self.relay = Histogram(f"{_PREFIX}_relay_seconds",
                               "Time from a TokenEvent frame arriving from the verifier to its bytes being handed "
                               "to the client (SSE chunk or WebSocket frame sent)",
                               ["transport"], buckets=_RELAY_BUCKETS, registry=r)
        self._drafted = 0
        self._accepted = 0

    def start(self, endpoint: str) -> RequestTimer:
        """Begin timing one request; the handler finishes it with the status it ended with."""
        return RequestTimer(self, endpoint)

    def relayed(self, transport: str, arrived: float) -> None:
        """One event's bytes went to the client (``transport``: sse or websocket); ``arrived`` is the
        ``time.perf_counter()`` at which its frame came in from the verifier."""
        self.relay.labels(transport).observe(time.perf_counter() - arrived)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.recent_ttft.add(seconds)

    def per_token(self, seconds: float) -> None:
        self.tpot.observe(seconds)
        self.recent_tpot.add(seconds)

    def finished(self, final: TokenEvent) -> None:
        """Account a request's final TokenEvent (its counts are cumulative for the request)."""
        self.prompt_tokens.inc(final.prompt_tokens)
        self.completion_tokens.inc(final.completion_tokens)
        self.drafted_tokens.inc(final.drafted_tokens)
        self.accepted_tokens.inc(final.accepted_tokens)
        self._drafted += final.drafted_tokens
        self._accepted += final.accepted_tokens
        if self._drafted:
            self.acceptance_rate.set(self._accepted / self._drafted)

    def render(self, queue_depth: int, drafters: int, verifier_up: bool) -> bytes:
        self.queue_depth.set(queue_depth)
        self.drafters.set(drafters)
        self.verifier_up.set(1 if verifier_up else 0)
        return generate_latest(self.registry)

