"""Without a grace (--orphan-grace-s 0), a coordinator that goes away takes its clients with it:
the verifier cancels the requests it sent (a drafter serving one hears a final "cancelled" Verdict
and can ack its queue entry) and refuses drafters' opens of its queued ones ("orphaned", so the
entry is acked, not computed for nobody); a coordinator that links again is served again. Another
coordinator's requests are untouched. (With a grace: test_verifier_adopt.py.)"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from shared.protocol import Draft, ErrorFrame, OpenSession, SamplingParams, SessionOpened, TokenEvent, Verdict, Welcome
from tests.integration.test_verifier import Running, collect_text, connect, serving

pytestmark = pytest.mark.asyncio

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest_asyncio.fixture
async def verifier(tiny_models: dict[str, Path]) -> AsyncIterator[Running]:
    # the scripted drafter drafts one round only
    async with serving(tiny_models, resume_grace_s=0.0, draft_timeout_s=1.0, orphan_grace_s=0.0) as running:
        yield running


async def sessions(url: str) -> int:
    """Open requests, target-only ones included (the gauge; /status counts speculative ones)."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(url.replace("ws://", "http://") + "/metrics")).text
    found = re.search(r"^specfleet_verifier_sessions (\S+)$", text, re.M)
    assert found, "no sessions gauge"
    return int(float(found.group(1)))


async def wait_sessions(url: str, n: int) -> None:
    for _ in range(200):
        if await sessions(url) == n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the verifier still holds {await sessions(url)} sessions, not {n}")


async def test_a_gone_coordinators_requests_are_cancelled_and_its_queued_ones_dropped(verifier: Running) -> None:
    fp, prompt = verifier.target.fingerprint, [3, 70, 71, 72]
    async with connect(verifier.url, "drafter", fp) as drafter, connect(verifier.url, "frontend", node_id="b") as b:
        await drafter.recv(Welcome)
        await b.recv(Welcome)
        async with connect(verifier.url, "frontend", node_id="a") as a:
            await a.recv(Welcome)
            await a.send(OpenSession(request_id="a-direct", prompt_ids=prompt, params=LONG, origin="a",
                                     speculative=False))
            await drafter.send(OpenSession(request_id="a-drafted", prompt_ids=prompt, params=LONG, origin="a"))
            assert isinstance(await drafter.recv(SessionOpened, ErrorFrame, rid="a-drafted"), SessionOpened)
            await b.send(OpenSession(request_id="b-direct", prompt_ids=prompt, params=LONG, origin="b",
                                     speculative=False))
            await a.recv(TokenEvent, rid="a-direct")  # running
        # coordinator a is gone: both of its requests end, b's goes on
        verdict = await drafter.recv(Verdict, rid="a-drafted")
        assert verdict.finished and verdict.finish_reason == "cancelled"
        await wait_sessions(verifier.url, 1)
        await drafter.send(OpenSession(request_id="a-queued", prompt_ids=prompt, params=LONG, origin="a"))
        refused = await drafter.recv(SessionOpened, ErrorFrame, rid="a-queued")
        assert isinstance(refused, ErrorFrame) and refused.code == "orphaned", refused
        _, _, last = await collect_text(b, "b-direct")
        assert last.finish_reason == "length" and last.completion_tokens == LONG.max_tokens
        async with connect(verifier.url, "frontend", node_id="a") as again:  # a is back: served again
            await again.recv(Welcome)
            short = SamplingParams(temperature=0.0, max_tokens=3)
            await drafter.send(OpenSession(request_id="a-later", prompt_ids=prompt, params=short, origin="a"))
            opened = await drafter.recv(SessionOpened, ErrorFrame, rid="a-later")
            assert isinstance(opened, SessionOpened), opened
            await drafter.send(Draft(request_id="a-later", round=0, token_ids=[]))
            assert (await collect_text(again, "a-later"))[2].finish_reason == "length"


async def test_a_second_link_of_the_same_coordinator_keeps_its_requests(verifier: Running) -> None:
    prompt = [3, 80, 81]
    async with connect(verifier.url, "frontend", node_id="c") as first:
        await first.recv(Welcome)
        async with connect(verifier.url, "frontend", node_id="c") as second:
            await second.recv(Welcome)
            await first.send(OpenSession(request_id="c-1", prompt_ids=prompt, params=LONG, origin="c",
                                         speculative=False))
            await first.recv(TokenEvent, rid="c-1")
        # the second link closed a few ms into a request of 400 steps: had that cancelled c's
        # requests, this one would end "cancelled"; the first link still relays all its tokens
        _, _, last = await collect_text(first, "c-1")
        assert last.finish_reason == "length" and last.completion_tokens == LONG.max_tokens
