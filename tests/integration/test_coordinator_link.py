"""The verifier link against a real loopback WebSocket peer, and the whole coordinator process path:
``serve()`` with its own in-process queue, drained by a drafter-side QueueLinkClient over the
coordinator's ``/internal/queue`` while the fake verifier answers over ``/v1/frontend``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.coordinator.config import CoordinatorConfig
from services.coordinator.main import main, serve
from services.coordinator.model_info import ModelInfo
from services.coordinator.verifier_link import Backoff, FrontendLink
from shared.config import from_flags
from shared.protocol import PROTOCOL_VERSION, TokenEvent
from shared.queue import open_queue
from tests.conftest import free_port
from tests.integration.coordinator_fakes import FakeVerifier, InProcess, expected_text, in_process


@pytest.fixture(scope="module")
def info(tiny_models: dict[str, Path]) -> ModelInfo:
    return ModelInfo.load(str(tiny_models["target"]))


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(fake: FakeVerifier, link: FrontendLink | None = None) -> AsyncIterator[None]:
    """Start the link against an already started fake; stop both at the end."""
    try:
        if link is not None:
            await link.start()
        yield
    finally:
        if link is not None:
            await link.stop()
        await fake.stop()


def event(rid: str, **kw: Any) -> TokenEvent:
    return TokenEvent(request_id=rid, origin="c1", token_ids=[5], text="x", **kw)


@pytest.mark.asyncio
async def test_handshake_status_routing_and_cancel(info: ModelInfo) -> None:
    fake = FakeVerifier(None, info.tokenizer, auth_token="tok", fingerprint=info.fingerprint, drafters=("d1", "d2"))
    await fake.start()
    link = FrontendLink(fake.url, "c1", auth_token="tok", tokenizer_fingerprint=info.fingerprint)
    async with running(fake, link):
        assert await link.wait_connected(5)
        await until(lambda: link.drafters == ["d1", "d2"])
        hello = fake.hellos[-1]
        assert (hello.role, hello.node_id, hello.protocol_version) == ("frontend", "c1", PROTOCOL_VERSION)
        assert hello.tokenizer_fingerprint == info.fingerprint
        assert fake.auth_headers[-1] == "Bearer tok"
        assert link.max_model_len == 512 and link.welcome is not None
        queue = link.subscribe("r1")
        with pytest.raises(ValueError, match="already"):
            link.subscribe("r1")
        await fake.emit("c1", event("unknown-request"))  # dropped, no crash
        await fake.emit("c1", event("r1", finished=True, finish_reason="stop"))
        got = (await asyncio.wait_for(queue.get(), 5)).event
        assert got.request_id == "r1" and got.finished
        await link.cancel("r1")
        await until(lambda: fake.cancels == ["r1"])
        link.unsubscribe("r1")
        link.unsubscribe("r1")  # idempotent
        await fake.send_status([])
        await until(lambda: link.drafters == [])


@pytest.mark.asyncio
@pytest.mark.parametrize(("fake_kw", "link_kw", "needle"), [
    ({"refuse": "go away"}, {}, "go away"),
    ({"auth_token": "right"}, {"auth_token": "wrong"}, "bad token"),
    ({"fingerprint": "ffff"}, {"tokenizer_fingerprint": "0000"}, "fingerprint ffff"),
])
async def test_refusals_keep_the_link_down_with_a_reason(
    info: ModelInfo, fake_kw: dict[str, Any], link_kw: dict[str, Any], needle: str
) -> None:
    fake = FakeVerifier(None, info.tokenizer, **fake_kw)
    await fake.start()
    link = FrontendLink(fake.url, "c1", **link_kw)
    async with running(fake, link):
        await until(lambda: needle in link.last_error)
        assert not link.connected
        link.cancel_nowait("r")  # dropped while down, no error


@pytest.mark.asyncio
async def test_drop_fails_in_flight_requests_and_reconnects(info: ModelInfo) -> None:
    fake = FakeVerifier(None, info.tokenizer)
    await fake.start()
    link = FrontendLink(fake.url, "c1", backoff=Backoff(min_s=0.05))
    async with running(fake, link):
        assert await link.wait_connected(5)
        queue = link.subscribe("r1")
        await fake.drop_frontends()
        failed = (await asyncio.wait_for(queue.get(), 5)).event
        assert failed.finished and failed.finish_reason == "cancelled" and "lost the link" in failed.error
        await until(lambda: len(fake.hellos) == 2 and link.connected)
        assert link.drafters == ["fake-drafter"]


@pytest.mark.asyncio
async def test_auto_drafts_for_the_share_of_new_requests_the_verifier_asks_for(info: ModelInfo) -> None:
    """``--speculation auto``: every request through the queue while the verifier's policy wants
    drafts; with a share of 1/4 (SmartSpec's probes while k = 0 is best), every fourth one, and the
    others straight to the verifier, target-only; all of them again once the share is back to 1."""
    async def routes(h: InProcess, n: int) -> list[str]:
        out = []
        for i in range(n):
            seen = len(h.fake.seen)
            resp = await h.http.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 4})
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected_text(4), resp.text
            out.append("q" if len(h.fake.seen) > seen else "t")  # queued for a drafter, else target-only
        return out

    async with in_process(info) as h:
        assert await routes(h, 2) == ["q", "q"]
        await h.fake.send_status(["fake-drafter"], draft_share=0.25)
        await until(lambda: h.state.link.draft_share == 0.25)
        assert await routes(h, 8) == ["t", "t", "t", "q"] * 2
        assert not any(o.speculative for o in h.fake.opened) and len(h.fake.opened) == 6
        await h.fake.send_status(["fake-drafter"], draft_share=1.0)
        await until(lambda: h.state.link.draft_share == 1.0)
        assert await routes(h, 2) == ["q", "q"]
        text = (await h.http.get("/metrics")).text
        assert 'specfleet_coordinator_routed_total{path="target_only"} 6.0' in text


@pytest.mark.asyncio
async def test_link_waits_for_a_verifier_that_starts_late(info: ModelInfo) -> None:
    port = free_port()
    link = FrontendLink(f"ws://127.0.0.1:{port}/v1/frontend", "c1", backoff=Backoff(min_s=0.05, max_s=0.2))
    await link.start()
    try:
        await asyncio.sleep(0.3)
        assert not link.connected and link.last_error
        from websockets.asyncio.server import serve as ws_serve

        fake = FakeVerifier(None, info.tokenizer)
        async with ws_serve(fake._handler, "127.0.0.1", port):
            assert await link.wait_connected(5)
    finally:
        await link.stop()


@pytest.mark.asyncio
async def test_serve_end_to_end_through_the_queue_link(info: ModelInfo) -> None:
    """The real process path: serve(cfg) with its MemoryQueue, drafters' /internal/queue link,
    the verifier link, /ready flipping when the verifier drops, and a completion over HTTP."""
    drafter_queue = None
    fake = FakeVerifier(None, info.tokenizer, auth_token="tok", fingerprint=info.fingerprint)
    await fake.start()
    port = free_port()
    cfg = from_flags(CoordinatorConfig, port=port,
                     model=info.root, verifier_url=fake.url, auth_token="tok", node_id="c-main")
    ready = asyncio.Event()
    server = asyncio.create_task(serve(cfg, ready))
    try:
        await asyncio.wait_for(ready.wait(), 15)
        drafter_queue = open_queue(f"ws://127.0.0.1:{port}/internal/queue", auth_token="tok")
        fake.queue = drafter_queue
        consumer = asyncio.create_task(fake._consume())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            await until(lambda: "c-main" in fake.frontends)
            assert (await http.get("/ready")).status_code == 200
            resp = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == expected_text(6)
            assert resp.json()["specfleet"] == {"drafted_tokens": 12, "accepted_tokens": 6}
            fake.refuse = "maintenance"
            await fake.drop_frontends()
            await until(lambda: "c-main" not in fake.frontends)
            ready_resp = await http.get("/ready")
            assert ready_resp.status_code == 503 and not ready_resp.json()["verifier_connected"]
            assert (await http.post("/v1/completions", json={"prompt": "hello"})).status_code == 503
            fake.refuse = ""
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        if drafter_queue is not None:
            await drafter_queue.close()
        await fake.stop()


def test_main_reports_a_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path / "missing"), "--port", str(free_port())]) == 2
    assert "does not exist" in capsys.readouterr().err
