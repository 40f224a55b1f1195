"""Two verifier replicas behind one coordinator (``--verifier-url a,b``), a drafter on each.

Requests are served by both replicas, each by one only (session affinity); one replica is
killed (SIGKILL, not restarted) mid-stream, and its requests fail over to the other: every
request completes, token-identical to target-only greedy, with no gap or duplicate in any
stream; the lost replica's drafter moves to the surviving replica (the next URL in its list),
and the fleet goes on serving there.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.models import load_model
from shared.supervisor import Child, Supervisor
from tests.conftest import free_port
from tests.e2e.greedy_streams import check_greedy, greedy_body, sample_metric_async, stream_text
from tests.e2e.stack import TOKEN, StackSpec, run_stack

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

N_REQUESTS = 24
MAX_TOKENS = 96
KILL_ATTEMPTS = 3  # rounds of requests to catch the victim with requests in flight
STALL_S = 2.0  # no stream moved for this long with the victim frozen: the unfinished ones are its


def body(tag: str, i: int) -> dict[str, Any]:
    return greedy_body(tag, i, MAX_TOKENS)


SESSIONS = "specfleet_verifier_sessions"  # sessions holding KV memory now
ROUNDS = "specfleet_verifier_rounds_total"  # rounds verified so far


def wait_for(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@contextmanager
def replica(target: Path, port: int, log_dir: Path) -> Iterator[Child]:
    """A second verifier, up before the fleet starts (so its drafter finds it first)."""
    sup = Supervisor(log_dir)
    argv = [sys.executable, "-m", "shared.cli", "verifier", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(target), "--torch-threads", "1", "--log-level", "warning", "--draft-len", "3"]
    child = sup.start("verifier-b", argv, {"SPECFLEET_AUTH_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"})
    try:
        sup.wait_ready(f"http://127.0.0.1:{port}/health", 120)
        yield child
    finally:
        sup.stop()


@pytest.mark.timeout(280)
def test_two_replicas_share_the_load_and_one_lost_fails_over(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    target = load_model(tiny_models["target"])
    port_a, port_b = free_port(), free_port()
    replicas = f"ws://127.0.0.1:{port_a}/v1/frontend,ws://127.0.0.1:{port_b}/v1/frontend"
    spec = StackSpec(drafts=[tiny_models["draft-L2"]] * 2, draft_mode="greedy", draft_len=3, max_sessions=12,
                     verifier_port=port_a, extra_coordinator=["--verifier-url", replicas],
                     extra_drafter=["--reconnect-s", "0.5"],
                     per_drafter=[[], ["--verifier-url", f"ws://127.0.0.1:{port_b}/v1/drafter,"
                                                         f"ws://127.0.0.1:{port_a}/v1/drafter"]])
    with replica(tiny_models["target"], port_b, tmp_path) as victim, \
            run_stack(tiny_models["target"], spec, tmp_path) as fleet:
        url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
        wait_for(lambda: len(httpx.get(fleet.base_url + "/ready").json().get("drafters", [])) == 2, 120,
                 "both replicas and their drafters")

        async def victim_serving(http: httpx.AsyncClient, streams: list[asyncio.Task[str]]) -> bool:
            """Wait until both replicas have verified rounds and the victim holds sessions; False
            when the streams finished first. Polled without blocking the streams' event loop."""
            while not all(t.done() for t in streams):
                if (await sample_metric_async(http, url_a + "/metrics", ROUNDS) > 0
                        and await sample_metric_async(http, url_b + "/metrics", ROUNDS) > 0
                        and await sample_metric_async(http, url_b + "/metrics", SESSIONS) > 0):
                    return True
                await asyncio.sleep(0.02)
            return False

        async def kill_mid_stream(http: httpx.AsyncClient, streams: list[asyncio.Task[str]],
                                  counts: list[list[int]]) -> bool:
            """Kill the victim while it holds streams that are not finished; False (the victim left
            running) when its share finished first.

            A sample of the victim's sessions gauge does not prove it still holds them when the kill
            lands (its share finished in between once in four tries on a loaded machine), so the
            victim is frozen first (SIGSTOP). Its streams then stall while the survivor's run to their
            end; once no stream has moved for STALL_S, an unfinished one is the victim's if it has
            streamed text. (One without text may be a request a drafter opened on the victim after the
            sample, whose first event never came: the coordinator has not placed it on any replica,
            so it is not the victim's to fail over; its drafter re-opens it on the survivor.)"""
            if not await victim_serving(http, streams):
                return False
            os.kill(victim.proc.pid, signal.SIGSTOP)
            last: list[tuple[int, bool]] = []
            still_since = time.monotonic()
            while time.monotonic() - still_since < STALL_S:
                now = [(c[0], t.done()) for c, t in zip(counts, streams, strict=True)]
                if now != last:
                    last, still_since = now, time.monotonic()
                await asyncio.sleep(0.1)
            held = any(not t.done() and c[0] > 0 for c, t in zip(counts, streams, strict=True))
            os.kill(victim.proc.pid, signal.SIGKILL if held else signal.SIGCONT)
            return held

        async def run(tag: str, n: int, kill: bool) -> tuple[list[str], bool]:
            async with httpx.AsyncClient(base_url=fleet.base_url, timeout=240) as http, \
                    httpx.AsyncClient(timeout=30) as probe:
                counts = [[0] for _ in range(n)]
                streams = [asyncio.ensure_future(stream_text(http, body(tag, i), counts[i])) for i in range(n)]
                killed = await kill_mid_stream(probe, streams, counts) if kill else False
                return list(await asyncio.gather(*streams)), killed

        for attempt in range(KILL_ATTEMPTS):
            tag = f"R{attempt}"
            texts, killed = asyncio.run(run(tag, N_REQUESTS, kill=True))
            check_greedy(target, [body(tag, i) for i in range(N_REQUESTS)], texts)
            if killed:
                break
        assert killed, f"in {KILL_ATTEMPTS} rounds of requests, none was in flight on both replicas at once"
        # the lost replica's drafter moves to the survivor (its next URL), which serves on alone
        wait_for(lambda: "drafter-2" in httpx.get(fleet.base_url + "/ready").json().get("drafters", []), 60,
                 "the lost replica's drafter on the surviving replica")
        check_greedy(target, [body("S", i) for i in range(8)], asyncio.run(run("S", 8, kill=False))[0])
    log = (tmp_path / "coordinator.log").read_text()
    moved = sum(int(json.loads(line).get("requests", 0)) for line in log.splitlines()
                if "its requests failed over" in line)
    assert moved >= 1, "the lost replica served nothing when it was killed"
    print(f"requests failed over from the lost replica: {moved} (round of requests {attempt + 1})")
