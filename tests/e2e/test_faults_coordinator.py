"""Two coordinators share one Redis queue; one is killed (SIGKILL) mid-stream.

* the other coordinator's requests all complete, token-identical to target-only greedy;
* the dead coordinator's requests are not computed for nobody: the verifier cancels the ones it
  was serving, and drafters drop (and acknowledge) the ones still queued;
* no queue entry stays pending: the stream's pending list drains to empty.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from shared.fleet import Fleet
from shared.models import load_model
from tests.conftest import free_port
from tests.e2e.greedy_streams import check_greedy, greedy_body, stream_text
from tests.e2e.stack import StackSpec, run_stack

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.redis]

PER_COORDINATOR = 12
MAX_TOKENS = 96
STREAM = "specfleet:coordinator-kill"


def body(tag: str, i: int) -> dict[str, Any]:
    return greedy_body(tag, i, MAX_TOKENS, "class {tag}{i}(")


def second_coordinator(fleet: Fleet, port: int) -> str:
    """Start another coordinator process on the same Redis queue; its base URL once ready."""
    first = next(c for c in fleet.supervisor.children if c.name == "coordinator")
    argv = list(first.argv)
    argv[argv.index("--port") + 1] = str(port)
    fleet.supervisor.start("coordinator-b", argv, first.env)
    base = f"http://127.0.0.1:{port}"
    fleet.supervisor.wait_ready(base + "/ready", 120)
    return base


def generated_tokens(fleet: Fleet) -> float:
    text = httpx.get(fleet.verifier_url + "/metrics").text
    return sum(float(m) for m in re.findall(r"^specfleet_verifier_generated_tokens_total (\S+)$", text, re.M))


def wait_drained(client: redis.Redis, timeout_s: float) -> int:
    """Pending entries of the drafters' group once it is empty, or what is left at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        pending = int(client.xpending(STREAM, "drafters")["pending"])
        if pending == 0 or time.monotonic() > deadline:
            return pending
        time.sleep(0.2)


@pytest.mark.timeout(280)
def test_a_killed_coordinator_loses_nothing_of_the_other_and_leaves_no_pending_entry(
        tiny_models: dict[str, Path], redis_url: str, tmp_path: Path) -> None:
    target = load_model(tiny_models["target"])
    flags = ["--queue-stream", STREAM]
    spec = StackSpec(drafts=[tiny_models["draft-L2"]], draft_mode="greedy", draft_len=3, max_sessions=4,
                     redis_url=redis_url, extra_coordinator=flags, extra_drafter=flags)
    with run_stack(tiny_models["target"], spec, tmp_path) as fleet:
        base_b = second_coordinator(fleet, free_port())
        victim = next(c for c in fleet.supervisor.children if c.name == "coordinator")

        async def run() -> list[str]:
            seen_a = [0]
            async with httpx.AsyncClient(base_url=fleet.base_url, timeout=120) as http_a, \
                    httpx.AsyncClient(base_url=base_b, timeout=120) as http_b:
                a = [asyncio.create_task(stream_text(http_a, body("A", i), seen_a)) for i in range(PER_COORDINATOR)]
                b = [asyncio.create_task(stream_text(http_b, body("B", i))) for i in range(PER_COORDINATOR)]
                while seen_a[0] < 20:  # A's first requests are being served, the rest still queued
                    await asyncio.sleep(0.02)
                os.kill(victim.proc.pid, signal.SIGKILL)
                await asyncio.gather(*a, return_exceptions=True)  # their clients lose the connection
                return list(await asyncio.gather(*b))

        check_greedy(target, [body("B", i) for i in range(PER_COORDINATOR)], asyncio.run(run()))
        client = redis.Redis.from_url(redis_url)
        assert wait_drained(client, 60) == 0, "queue entries stayed pending after their coordinator died"
        # A's requests were mostly not computed: far fewer tokens than both coordinators' full work
        generated = generated_tokens(fleet)
        print(f"verifier generated {generated:.0f} tokens; B alone needed {PER_COORDINATOR * MAX_TOKENS}")
        assert generated < PER_COORDINATOR * MAX_TOKENS * 1.6
        verifier_log = (tmp_path / "verifier.log").read_text()
        assert "coordinator gone; its requests cancelled" in verifier_log
