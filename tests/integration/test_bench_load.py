"""The load generator against a WebSocket server that streams tokens like the coordinator."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
import websockets

from bench.client import run_arrivals, run_load


async def _coordinator(ws: Any) -> None:
    """Per request: 3 token frames 10 ms apart, then done."""
    async for raw in ws:
        body = json.loads(raw)
        for i in range(3):
            await asyncio.sleep(0.01)
            await ws.send(json.dumps({"type": "token", "token_ids": [i], "text": "x"}))
        await ws.send(json.dumps({"type": "done", "specfleet": {"drafted_tokens": body["max_tokens"],
                                                                "accepted_tokens": 1}}))


@pytest.mark.asyncio
async def test_closed_and_open_loop_loads_count_tokens_and_latencies() -> None:
    async with websockets.serve(_coordinator, "127.0.0.1", 0) as server:
        url = f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
        bodies = [{"max_tokens": 3} for _ in range(6)]
        wall, outs = await run_load(url, bodies, 2)
        assert wall > 0
        assert len(outs) == 6 and all(o.tokens == 3 and o.drafted == 3 for o in outs)
        assert all(o.ttft_s >= 0.01 and o.tpot_s >= 0.009 for o in outs)
        # each socket sends its next request once its last ended (3 frames 10 ms apart): the third
        # send comes after a first request's end
        sends = sorted(o.sent_s for o in outs)
        assert 0 <= sends[0] <= sends[1] < sends[2] and sends[2] >= 0.03 and sends[-1] < wall
        started = time.perf_counter()
        _wall, outs = await run_arrivals(url, bodies, [0.0, 0.0, 0.05, 0.05, 0.1, 0.2])
        assert len(outs) == 6 and time.perf_counter() - started >= 0.2  # the last one arrived at 0.2 s
        assert max(o.sent_s for o in outs) >= 0.2  # sent at its arrival, after its socket connected
        with pytest.raises(ValueError, match="arrival times"):
            await run_arrivals(url, bodies, [0.0])
