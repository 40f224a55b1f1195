"""Graceful shutdown of the coordinator (vLLM's contract): SIGTERM drains, refuses, exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.models import load_model
from tests.conftest import greedy_reference
from tests.e2e.stack import StackSpec, run_stack
from tests.e2e.test_faults_verifier import Progress, body, sse_one
from tests.e2e.test_full_stack import prompt_ids

pytestmark = [pytest.mark.e2e, pytest.mark.faults]


@pytest.mark.timeout(200)
def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_zero(tiny_models: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    """SIGTERM on the coordinator: /ready and new requests answer 503 at once, the streams in
    flight run to their end unaltered, and the process exits 0 (vLLM's shutdown contract)."""
    target = load_model(tiny_models["target"])
    spec = StackSpec(drafts=[tiny_models["draft-L2"]], draft_mode="greedy",
                     extra_coordinator=["--drain-timeout-s", "120"])
    reqs = [{**body(i), "max_tokens": 300} for i in range(6)]
    with run_stack(tiny_models["target"], spec, tmp_path) as fleet:
        coordinator = next(c for c in fleet.supervisor.children if c.name == "coordinator")

        async def run() -> tuple[list[dict[str, Any]], list[httpx.Response], bool]:
            progress = Progress()
            async with httpx.AsyncClient(base_url=fleet.base_url, timeout=httpx.Timeout(150.0)) as http:
                streams = [asyncio.create_task(sse_one(http, req, progress)) for req in reqs]
                while progress.tokens < len(reqs):  # every stream has begun
                    await asyncio.sleep(0.02)
                os.kill(coordinator.proc.pid, signal.SIGTERM)
                while (ready := await http.get("/ready")).status_code == 200:
                    await asyncio.sleep(0.01)
                in_flight = not all(s.done() for s in streams)
                refused = [ready, await http.post("/v1/completions", json=body(99))]
                return await asyncio.gather(*streams), refused, in_flight

        results, refused, in_flight = asyncio.run(run())
        code = coordinator.proc.wait(60)
    assert in_flight, "the streams ended before the drain began: nothing was drained"
    assert code == 0
    assert [r.status_code for r in refused] == [503, 503]
    assert "shutting down" in refused[1].json()["error"]["message"]
    for req, got in zip(reqs, results, strict=True):
        ids = prompt_ids(target, {"kind": "completion", **req})
        ref = greedy_reference(target.model, ids, 300, set())
        assert got["text"] == target.tokenizer.decode(ref, skip_special_tokens=True)
        assert got["finish_reason"] == "length" and got["usage"]["completion_tokens"] == 300
