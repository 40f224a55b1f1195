"""The soak (``make soak``, slow tier): the fleet in Redis mode under steady mixed traffic for
``SPECFLEET_SOAK_S`` seconds (default 600), while a fault injector kills (SIGKILL) a drafter or the
verifier every ``SPECFLEET_SOAK_FAULT_S`` seconds (default 30) and starts it again, as
``specfleet up`` would.

At the end: no request was lost (every one answered 200 and completed), every greedy one is
token-identical to target-only decoding, no queue entry is left pending, and no service's
resident memory grew by more than ``RSS_MARGIN_MB`` between the first fault-free minute and
the end (a leak shows up as steady growth over the run).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from shared.fleet import Fleet
from shared.models import load_model
from shared.supervisor import Child
from tests.conftest import greedy_reference
from tests.e2e.stack import StackSpec, run_stack
from tests.e2e.test_full_stack import prompt_ids

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.faults, pytest.mark.redis]

SOAK_S = float(os.environ.get("SPECFLEET_SOAK_S", "600"))
FAULT_EVERY_S = float(os.environ.get("SPECFLEET_SOAK_FAULT_S", "30"))
CLIENTS = 8
MAX_TOKENS = 32
PROMPTS = 12  # greedy references are computed once per prompt
RSS_MARGIN_MB = 96
STREAM = "specfleet:soak"


@dataclass
class Ledger:
    done: int = 0
    failures: list[str] = field(default_factory=list)
    greedy: dict[int, set[str]] = field(default_factory=dict)  # prompt -> texts seen


def body(i: int, greedy: bool, stream: bool) -> dict[str, Any]:
    return {"model": "target", "prompt": f"def soak{i % PROMPTS}(x", "max_tokens": MAX_TOKENS,
            "temperature": 0 if greedy else 1.0, "ignore_eos": True, "stream": stream}


async def request(http: httpx.AsyncClient, i: int, ledger: Ledger) -> None:
    greedy, stream = i % 2 == 0, i % 3 != 0
    req = body(i, greedy, stream)
    if stream:
        text, reason = "", None
        async with http.stream("POST", "/v1/completions", json=req) as resp:
            if resp.status_code != 200:
                ledger.failures.append(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        ledger.failures.append(f"stream error: {chunk['error']}")
                        return
                    text += chunk["choices"][0]["text"]
                    reason = chunk["choices"][0]["finish_reason"] or reason
    else:
        resp = await http.post("/v1/completions", json=req)
        if resp.status_code != 200:
            ledger.failures.append(f"{resp.status_code}: {resp.text[:200]}")
            return
        text, reason = resp.json()["choices"][0]["text"], resp.json()["choices"][0]["finish_reason"]
    if reason != "length":
        ledger.failures.append(f"finish_reason {reason}")
        return
    ledger.done += 1
    if greedy:
        ledger.greedy.setdefault(i % PROMPTS, set()).add(text)


async def clients(fleet: Fleet, ledger: Ledger, until: float) -> None:
    async def one_client(c: int) -> None:
        async with httpx.AsyncClient(base_url=fleet.base_url, timeout=300) as http:
            i = c
            while time.monotonic() < until:
                await request(http, i, ledger)
                i += CLIENTS

    await asyncio.gather(*(one_client(c) for c in range(CLIENTS)))


async def faults(fleet: Fleet, until: float, rng: random.Random) -> int:
    victims = [c for c in fleet.supervisor.children if c.name == "verifier" or c.name.startswith("drafter")]
    kills = 0
    while time.monotonic() + FAULT_EVERY_S < until:
        await asyncio.sleep(FAULT_EVERY_S)
        victim = rng.choice(victims)
        os.kill(victim.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(victim.proc.wait, 10)
        fleet.supervisor.restart(victim)
        kills += 1
    return kills


def rss_mb(child: Child) -> float:
    for line in Path(f"/proc/{child.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.timeout(SOAK_S + 900)
def test_soak_under_faults(tiny_models: dict[str, Path], redis_url: str, tmp_path: Path) -> None:
    target = load_model(tiny_models["target"])
    flags = ["--queue-stream", STREAM]
    spec = StackSpec(drafts=[tiny_models["draft-L1"], tiny_models["draft-L2"]], draft_len=3, max_sessions=8,
                     redis_url=redis_url, extra_coordinator=flags, extra_drafter=[*flags, "--reconnect-s", "0.5"])
    ledger = Ledger()
    with run_stack(tiny_models["target"], spec, tmp_path) as fleet:
        coordinator = next(c for c in fleet.supervisor.children if c.name == "coordinator")

        async def run() -> tuple[int, float, float]:
            start = time.monotonic()
            warm = start + min(60.0, SOAK_S / 5)
            await clients(fleet, ledger, warm)  # fault-free warm-up; the memory baseline after it
            before = rss_mb(coordinator)
            until = time.monotonic() + SOAK_S - (warm - start)
            kills, _ = await asyncio.gather(faults(fleet, until, random.Random(5)), clients(fleet, ledger, until))
            return kills, before, rss_mb(coordinator)

        kills, before, after = asyncio.run(run())
        pending = int(redis.Redis.from_url(redis_url).xpending(STREAM, "drafters")["pending"])
    print(f"soak {SOAK_S:.0f} s: {ledger.done} requests, {kills} kills, coordinator RSS {before:.0f} -> "
          f"{after:.0f} MB, failures {len(ledger.failures)}")
    assert not ledger.failures, ledger.failures[:5]
    assert pending == 0, f"{pending} queue entries left pending"
    assert after - before < RSS_MARGIN_MB, f"the coordinator grew from {before:.0f} to {after:.0f} MB"
    for p, texts in ledger.greedy.items():
        ids = prompt_ids(target, {"kind": "completion", **body(p, True, False)})
        want = target.tokenizer.decode(greedy_reference(target.model, ids, MAX_TOKENS, set()), skip_special_tokens=True)
        assert texts == {want}, f"prompt {p}: greedy output differed across the soak"
