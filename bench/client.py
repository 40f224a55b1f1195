"""A load generator over the coordinator's WebSocket token stream (exact token counts).

Closed loop (``run_load``): ``concurrency`` sockets, each sending its next request when the last
one finished. Open loop (``run_arrivals``): requests arrive at given times (a seeded Poisson
process from :func:`poisson_arrivals`, or a trace), each on a socket of its own, whatever is
still running. Every outcome records its time to first token and time per output token.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import websockets


@dataclass(frozen=True)
class Outcome:
    tokens: int
    latency_s: float
    drafted: int
    accepted: int
    ttft_s: float = 0.0  # request sent -> first token frame
    tpot_s: float = 0.0  # mean time per output token after the first
    slo_tokens_per_s: float | None = None  # the request's SLO class (its ``slo_tokens_per_s``), if it had one
    sent_s: float = 0.0  # when it was sent, seconds from the start of its run (its sockets connect inside it)

    @classmethod
    def of(cls, tokens: int, started: float, first: float, ended: float, extra: dict[str, Any],
           slo_tokens_per_s: float | None = None, origin: float | None = None) -> Outcome:
        ttft = (first or ended) - started
        tpot = (ended - first) / (tokens - 1) if first and tokens > 1 else 0.0
        return cls(tokens, ended - started, int(extra.get("drafted_tokens", 0)), int(extra.get("accepted_tokens", 0)),
                   ttft, tpot, slo_tokens_per_s, started - origin if origin is not None else 0.0)

    @property
    def slo_met(self) -> bool:
        """Whether the request met its SLO class as its user saw it: its tokens over the whole time
        from sending it to its last token (queueing and prefill included) at least the class's speed."""
        return self.slo_tokens_per_s is None or self.tokens >= self.slo_tokens_per_s * self.latency_s


async def _one(ws: Any, body: dict[str, Any], origin: float | None = None) -> Outcome:
    """Send ``body`` and read its stream to the end; ``origin``: the run's start (``perf_counter``)."""
    started = time.perf_counter()
    first = 0.0
    await ws.send(json.dumps(body))
    tokens = 0
    while True:
        frame = json.loads(await ws.recv())
        if frame["type"] == "token":
            if frame["token_ids"] and not first:
                first = time.perf_counter()
            tokens += len(frame["token_ids"])
        elif frame["type"] == "done":
            return Outcome.of(tokens, started, first, time.perf_counter(), frame.get("specfleet", {}),
                              body.get("slo_tokens_per_s"), origin)
        else:
            raise RuntimeError(f"request failed: {frame}")


async def run_load(ws_url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[float, list[Outcome]]:
    """Send every body over ``concurrency`` sockets; returns (wall seconds, outcomes)."""
    todo = list(reversed(bodies))
    outcomes: list[Outcome] = []
    started = time.perf_counter()

    async def worker() -> None:
        async with websockets.connect(ws_url, max_size=None) as ws:
            while todo:
                outcomes.append(await _one(ws, todo.pop(), started))

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return time.perf_counter() - started, outcomes


def poisson_arrivals(rate_per_s: float, n: int, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` requests at ``rate_per_s`` on average."""
    if rate_per_s <= 0:
        raise ValueError("the arrival rate must be > 0 requests per second")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


async def run_arrivals(ws_url: str, bodies: list[dict[str, Any]],
                       arrivals: Sequence[float]) -> tuple[float, list[Outcome]]:
    """Open loop: body i is sent at ``arrivals[i]`` seconds, on a socket of its own."""
    if len(arrivals) != len(bodies):
        raise ValueError(f"{len(bodies)} requests but {len(arrivals)} arrival times")
    started = time.perf_counter()

    async def one(body: dict[str, Any], at: float) -> Outcome:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        async with websockets.connect(ws_url, max_size=None) as ws:
            return await _one(ws, body, started)

    outcomes = await asyncio.gather(*(one(b, at) for b, at in zip(bodies, arrivals, strict=True)))
    return time.perf_counter() - started, list(outcomes)


def percentiles(values: Sequence[float], points: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """``{"p50": ..., "p90": ..., "p99": ...}`` (0 for no values)."""
    if not values:
        return {f"p{p}": 0.0 for p in points}
    if len(values) == 1:
        return {f"p{p}": float(values[0]) for p in points}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {f"p{p}": cuts[p - 1] for p in points}
