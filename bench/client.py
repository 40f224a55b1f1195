"""A load generator over the coordinator's WebSocket token stream (exact token counts)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import websockets


@dataclass(frozen=True)
class Outcome:
    tokens: int
    latency_s: float
    drafted: int
    accepted: int


async def _one(ws: Any, body: dict[str, Any]) -> Outcome:
    started = time.perf_counter()
    await ws.send(json.dumps(body))
    tokens = 0
    while True:
        frame = json.loads(await ws.recv())
        if frame["type"] == "token":
            tokens += len(frame["token_ids"])
        elif frame["type"] == "done":
            extra = frame.get("specfleet", {})
            return Outcome(tokens, time.perf_counter() - started, int(extra.get("drafted_tokens", 0)),
                           int(extra.get("accepted_tokens", 0)))
        else:
            raise RuntimeError(f"request failed: {frame}")


async def run_load(ws_url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[float, list[Outcome]]:
    """Send every body over ``concurrency`` sockets; returns (wall seconds, outcomes)."""
    todo = list(reversed(bodies))
    outcomes: list[Outcome] = []

    async def worker() -> None:
        async with websockets.connect(ws_url, max_size=None) as ws:
            while todo:
                outcomes.append(await _one(ws, todo.pop()))

    started = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return time.perf_counter() - started, outcomes
