"""With a grace (--orphan-grace-s), a client's stream outlives its coordinator: the verifier keeps
a gone or released coordinator's requests running, unrelayed, and replays each one's events to
the coordinator that adopts it (Adopt), then relays it there; a finished one's events are kept as
long; a request not opened yet is routed to its adopter when a drafter opens it; an orphan nobody
adopts is cancelled after the grace; a coordinator whose link drops takes its requests back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from bench.delay_proxy import DelayProxy
from bench.delay_proxy import Link as ProxyLink
from services.coordinator.verifier_link import Backoff, FrontendLink
from shared.protocol import (
    Adopt,
    Adopted,
    Draft,
    ErrorFrame,
    OpenSession,
    Release,
    SamplingParams,
    SessionOpened,
    TokenEvent,
    Verdict,
    Welcome,
)
from tests.conftest import greedy_reference
from tests.integration.test_verifier import TOKEN, Peer, Running, connect, serving

pytestmark = pytest.mark.asyncio

PROMPT = [3, 70, 71, 72]
LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
GRACE_S = 1.5


@pytest_asyncio.fixture
async def verifier(tiny_models: dict[str, Path]) -> AsyncIterator[Running]:
    async with serving(tiny_models, resume_grace_s=0.0, draft_timeout_s=1.0, orphan_grace_s=GRACE_S) as running:
        yield running


async def events_until_final(peer: Peer, rid: str) -> list[TokenEvent]:
    out = []
    while not out or not out[-1].finished:
        out.append(await peer.recv(TokenEvent, rid=rid))
    return out


def check_whole(events: list[TokenEvent], running: Running, params: SamplingParams = LONG) -> None:
    """Numbered 1, 2, ... without a gap or a repeat, and together exactly target-only greedy output."""
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    ids = [t for e in events for t in e.token_ids]
    assert ids == greedy_reference(running.target.model, PROMPT, params.max_tokens, set())
    assert events[-1].finished and events[-1].finish_reason == "length"


async def test_a_gone_coordinators_request_runs_on_and_another_adopts_it(verifier: Running) -> None:
    async with connect(verifier.url, "frontend", node_id="b") as b:
        await b.recv(Welcome)
        async with connect(verifier.url, "frontend", node_id="a") as a:
            await a.recv(Welcome)
            await a.send(OpenSession(request_id="r1", prompt_ids=PROMPT, params=LONG, origin="a", speculative=False))
            seen = [await a.recv(TokenEvent, rid="r1") for _ in range(3)]
        await asyncio.sleep(0.3)  # a is gone; r1 runs on, relayed to nobody
        await b.send(Adopt(request_id="r1"))
        reply = await b.recv(Adopted, rid="r1")
        assert reply.state in ("live", "finished") and reply.first_seq == 1 and reply.last_seq >= 3
        events = await events_until_final(b, "r1")
        assert events[:3] == seen  # the replay starts with what a relayed
        check_whole(events, verifier)


async def test_a_released_request_moves_and_its_old_coordinator_hears_so(verifier: Running) -> None:
    async with connect(verifier.url, "frontend", node_id="a") as a, connect(verifier.url, "frontend",
                                                                             node_id="b") as b:
        await a.recv(Welcome)
        await b.recv(Welcome)
        await a.send(OpenSession(request_id="r2", prompt_ids=PROMPT, params=LONG, origin="a", speculative=False))
        await a.recv(TokenEvent, rid="r2")
        await b.send(Adopt(request_id="r2"))  # without a Release first: a still relays it
        assert (await b.recv(Adopted, rid="r2")).state == "live"
        moved = await a.recv(TokenEvent, rid="r2")
        while not moved.finished:  # events a got before the Adopt
            moved = await a.recv(TokenEvent, rid="r2")
        assert moved.error_code == "moved" and moved.seq == 0
        check_whole(await events_until_final(b, "r2"), verifier)
        # released, then adopted back: a finished request's events are all kept
        await b.send(Release(request_id="r2"))
        await a.send(Adopt(request_id="r2"))
        reply = await a.recv(Adopted, rid="r2")
        assert reply.state == "finished"
        check_whole(await events_until_final(a, "r2"), verifier)


async def test_an_adopter_gets_a_request_a_drafter_opens_later(verifier: Running) -> None:
    fp = verifier.target.fingerprint
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    async with connect(verifier.url, "drafter", fp) as drafter, connect(verifier.url, "frontend",
                                                                         node_id="b") as b:
        await drafter.recv(Welcome)
        await b.recv(Welcome)
        await b.send(Adopt(request_id="r3"))
        assert (await b.recv(Adopted, rid="r3")).state == "unknown"
        await drafter.send(OpenSession(request_id="r3", prompt_ids=PROMPT, params=short, origin="a-gone"))
        assert isinstance(await drafter.recv(SessionOpened, ErrorFrame, rid="r3"), SessionOpened)
        await drafter.send(Draft(request_id="r3", round=0, token_ids=[]))
        check_whole(await events_until_final(b, "r3"), verifier, short)


async def test_an_orphan_nobody_adopts_is_cancelled_after_the_grace_then_forgotten(
        tiny_models: dict[str, Path]) -> None:
    grace = 1.0
    async with serving(tiny_models, resume_grace_s=0.0, draft_timeout_s=60.0, orphan_grace_s=grace,
                       fill=False) as running:
        fp = running.target.fingerprint
        async with connect(running.url, "drafter", fp) as drafter:
            await drafter.recv(Welcome)
            async with connect(running.url, "frontend", node_id="a") as a:
                await a.recv(Welcome)
                # a drafter that never drafts: the request waits (60 s) for its first draft
                await drafter.send(OpenSession(request_id="r4", prompt_ids=PROMPT, params=LONG, origin="a"))
                assert isinstance(await drafter.recv(SessionOpened, ErrorFrame, rid="r4"), SessionOpened)
            gone = time.monotonic()
            verdict = await drafter.recv(Verdict, rid="r4", timeout=10)  # then cancelled: nobody adopted it
            assert verdict.finished and verdict.finish_reason == "cancelled"
            # a is gone; r4 was kept for a resume for the grace (a sample of the sessions gauge half a grace
            # in raced the cancellation on a loaded machine; the verifier may see the close a little
            # before the client's context exits)
            assert time.monotonic() - gone >= grace - 0.1
            async with connect(running.url, "frontend", node_id="b") as b:
                await b.recv(Welcome)
                await b.send(Adopt(request_id="r4"))
                reply = await b.recv(Adopted, rid="r4")
                assert reply.state == "finished"  # its one event, the final "cancelled", is kept a grace more
                final = await b.recv(TokenEvent, rid="r4")
                assert final.finish_reason == "cancelled" and final.seq == reply.last_seq == 1
                await asyncio.sleep(grace + 0.5)
                await b.send(Adopt(request_id="r4"))
                assert (await b.recv(Adopted, rid="r4")).state == "gone"


async def test_a_coordinator_whose_link_keeps_dropping_loses_no_token(verifier: Running) -> None:
    """Each time its link comes back to the same verifier, the coordinator adopts its requests
    again; the replayed events it relayed before are dropped by their seq."""
    host, port = verifier.url.removeprefix("ws://").split(":")
    proxy = DelayProxy(ProxyLink(disconnect_after_s=0.4), (host, int(port)))
    proxy_port = await proxy.start("127.0.0.1")
    link = FrontendLink(f"ws://127.0.0.1:{proxy_port}/v1/frontend", "coord-x", TOKEN, backoff=Backoff(min_s=0.05))
    await link.start()
    try:
        assert await link.wait_connected(10)
        slow = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        opened = OpenSession(request_id="r5", prompt_ids=PROMPT, params=slow, origin="coord-x", speculative=False)
        queue = link.subscribe("r5", opened)
        link.open_target_only(opened)
        events = []
        while not events or not events[-1].finished:
            events.append((await asyncio.wait_for(queue.get(), 30)).event)
            if len(events) == 1:  # once now, whatever the host's speed (a fast one decodes 400 tokens in 0.4 s)
                proxy.drop()
        assert proxy.connections >= 2, "the link never dropped during the request"
        check_whole(events, verifier, slow)
    finally:
        await link.stop()
        await proxy.close()
