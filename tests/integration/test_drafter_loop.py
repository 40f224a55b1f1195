"""The drafter against a scripted verifier on a real loopback WebSocket, with the in-process queue.

See ``drafter_scripted_verifier.py`` for the script: it accepts one draft token a round, adds
its own, and checks that every greedy draft is the draft model's true continuation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from services.drafter.config import DrafterConfig
from services.drafter.link import LinkDown, LinkRefused, VerifierLink
from services.drafter.main import main
from services.drafter.main import serve as serve_drafter
from services.drafter.sessions import DraftSession
from shared.config import from_flags
from shared.models import LoadedModel, load_model, make_tiny_family
from shared.protocol import PROTOCOL_VERSION, Hello, QueuedRequest, SamplingParams
from shared.queue import Delivery
from shared.queue_memory import MemoryQueue
from tests.integration.drafter_scripted_verifier import ScriptedVerifier, greedy_continuation

torch.set_num_threads(1)
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_family(Path(tmp_path_factory.getbasetemp()) / "tiny-family")["draft-L1"]


@pytest.fixture(scope="module")
def draft(draft_dir: Path) -> LoadedModel:
    return load_model(draft_dir)


@dataclass
class Harness:
    verifier: ScriptedVerifier
    queue: RecordingQueue
    ended: dict[str, DraftSession]
    url: str

    async def wait_for(self, what: Callable[[], bool], timeout_s: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            assert time.monotonic() < deadline, "timed out waiting for the drafter"
            await asyncio.sleep(0.01)


class RecordingQueue(MemoryQueue):
    """The real in-process queue, remembering acks and releases."""

    def __init__(self) -> None:
        super().__init__()
        self.acked: list[str] = []
        self.releases = 0
        self.rooms: list[int] = []  # the room each get that brought a request said

    async def get(self, consumer: str, max_items: int = 1, timeout_s: float | None = None,
                  room: int = 0) -> list[Delivery]:
        out = await super().get(consumer, max_items, timeout_s, room)
        self.rooms += [room] if out else []
        return out

    async def ack(self, consumer: str, delivery_id: str) -> None:
        self.acked.append(delivery_id)
        await super().ack(consumer, delivery_id)

    async def release(self, consumer: str) -> None:
        self.releases += 1
        await super().release(consumer)


def request(rid: str, prompt: list[int], **params: object) -> QueuedRequest:
    return QueuedRequest(request_id=rid, prompt_ids=prompt, params=SamplingParams(**params),  # type: ignore[arg-type]
                         origin="coordinator-test", model="tiny", created_at=time.time())


def drafter_config(url: str, **overrides: object) -> DrafterConfig:
    return from_flags(DrafterConfig, **{"verifier_url": url, "node_id": "drafter-test", "max_sessions": 2,  # type: ignore[arg-type]
                            "reconnect_s": 0.05, "auth_token": "sekrit", **overrides})


@contextlib.asynccontextmanager
async def running(draft: LoadedModel, verifier: ScriptedVerifier, **overrides: object) -> AsyncIterator[Harness]:
    """A scripted verifier on an ephemeral port and a drafter serving from a fresh queue."""
    server: Server = await serve(verifier.handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1] if server.sockets else 0
    url = f"ws://127.0.0.1:{port}/v1/drafter"
    queue = RecordingQueue()
    ended: dict[str, DraftSession] = {}
    cfg = drafter_config(url, **overrides)
    task = asyncio.create_task(serve_drafter(cfg, queue=queue, model=draft,
                                             on_session_end=lambda s: ended.__setitem__(s.request_id, s)))
    try:
        yield Harness(verifier, queue, ended, url)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        server.close()
        await server.wait_closed()


PROMPTS = {"r1": [12, 40, 77, 5], "r2": [9, 9, 130, 64, 3, 88], "r3": [200, 14]}


@pytest.mark.asyncio
async def test_sessions_commit_the_verifiers_tokens_and_ack(draft: LoadedModel) -> None:
    verifier = ScriptedVerifier(draft, finish_after=7)
    async with running(draft, verifier) as h:
        for rid, prompt in PROMPTS.items():
            await h.queue.put(request(rid, prompt, temperature=0.0, max_tokens=7))
        await h.wait_for(lambda: len(h.ended) == 3 and len(h.queue.acked) == 3)
    assert verifier.problems == []  # every draft was the draft model's greedy continuation
    assert all(d.q is None for d in verifier.drafts)  # greedy requests get ids only (sampled mode)
    assert verifier.auth_headers == ["Bearer sekrit"]
    hello = verifier.hellos[0]
    assert (hello.role, hello.node_id, hello.protocol_version) == ("drafter", "drafter-test", PROTOCOL_VERSION)
    assert hello.tokenizer_fingerprint == draft.fingerprint and hello.max_sessions == 2
    assert verifier.concurrent_max == 2  # admission fills both slots, never more
    # each pull says the sessions left: 2, then 1 beside the first session, then what ended
    assert h.queue.rooms[:2] == [2, 1] and h.queue.rooms[2] in (1, 2)
    # each OpenSession says how long its request waited since the coordinator took it (v8): the third
    # request waited in the queue for one of the first two to end
    assert all(0.0 <= w < 30.0 for w in verifier.waited.values())
    assert verifier.waited[verifier.opens[-1]] > max(verifier.waited[r] for r in verifier.opens[:2])
    for rid, prompt in PROMPTS.items():
        session = h.ended[rid]
        assert session.committed == verifier.committed[rid]
        assert session.committed[: len(prompt)] == prompt and session.generated == 7
        assert session.finish_reason == "length"
        sent = [d for d in verifier.drafts if d.request_id == rid]
        assert [d.round for d in sent] == list(range(len(sent))) == list(range(session.stats.rounds))
        assert session.stats.accepted == sum(1 for d in sent if d.token_ids)  # the script accepts one a round
    # Never more drafts than can be used: with 7 tokens, 2 a round, the lengths go 3, 3, 2, then 0.
    assert [len(d.token_ids) for d in verifier.drafts if d.request_id == "r1"] == [3, 3, 2, 0]
    assert await h.queue.depth() == 0 and h.queue.in_flight() == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(("overrides", "max_entries"), [({}, 4096), ({"q_mass": 0.9, "q_max_entries": 8}, 8)],
                         ids=["default", "small-nucleus"])
async def test_sampled_mode_sends_a_valid_sparse_q(draft: LoadedModel, overrides: dict[str, object],
                                                   max_entries: int) -> None:
    verifier = ScriptedVerifier(draft, finish_after=5)
    async with running(draft, verifier, **overrides) as h:  # draft_mode defaults to sampled
        await h.queue.put(request("warm", [12, 40, 77], temperature=0.8, seed=1, max_tokens=5))
        await h.queue.put(request("cold", [12, 40, 77], temperature=0.0, max_tokens=5))
        await h.wait_for(lambda: len(h.queue.acked) == 2)
    warm = [d for d in verifier.drafts if d.request_id == "warm" and d.token_ids]
    cold = [d for d in verifier.drafts if d.request_id == "cold" and d.token_ids]
    assert warm and all(d.q is not None and len(d.q) == len(d.token_ids) for d in warm)
    assert all(len(q.ids) // 4 == len(q.probs) // 2 <= max_entries for d in warm for q in d.q or [])
    assert cold and all(d.q is None for d in cold)
    assert verifier.problems == []  # every q was valid and the draft model's distribution


@pytest.mark.asyncio
@pytest.mark.parametrize("conditional", [True, False])
async def test_lookaheads_go_out_before_their_verdicts_and_are_not_sent_twice(draft: LoadedModel,
                                                                             conditional: bool) -> None:
    """A target that agrees with the draft model: every lookahead comes true. With a verifier that
    takes conditional drafts, each round after the first is served by the lookahead the drafter
    sent before the previous verdict, and the drafter sends that round no other draft; without,
    the drafter sends each round's draft after its verdict, as before."""
    verifier = ScriptedVerifier(draft, finish_after=24, oracle=True, conditional=conditional, verdict_delay_s=0.05)
    async with running(draft, verifier, max_sessions=1) as h:
        await h.queue.put(request("r", [12, 40, 77, 5], temperature=0.0, max_tokens=24))
        await h.wait_for(lambda: len(h.queue.acked) == 1)
    assert verifier.problems == []  # no round got two drafts; each was the greedy continuation
    session = h.ended["r"]
    assert session.committed == [12, 40, 77, 5, *greedy_continuation(draft, [12, 40, 77, 5], 24)]
    if conditional:  # one plain draft (round 0), then lookaheads, each taken before the edge heard the verdict
        assert len(verifier.drafts) == 1 and len(verifier.taken) == session.stats.rounds - 1 >= 4
    else:
        assert not verifier.taken and len(verifier.drafts) == session.stats.rounds


@pytest.mark.asyncio
async def test_greedy_mode_sends_ids_only_at_any_temperature(draft: LoadedModel) -> None:
    verifier = ScriptedVerifier(draft, finish_after=5)
    async with running(draft, verifier, draft_mode="greedy") as h:
        await h.queue.put(request("warm", [12, 40, 77], temperature=0.8, seed=1, max_tokens=5))
        await h.wait_for(lambda: len(h.queue.acked) == 1)
    warm = [d for d in verifier.drafts if d.request_id == "warm" and d.token_ids]
    assert warm and all(d.q is None for d in warm)
    assert verifier.problems == []  # and each was the draft model's argmax continuation


@pytest.mark.asyncio
async def test_cancel_drops_the_session_and_acks(draft: LoadedModel) -> None:
    verifier = ScriptedVerifier(draft, finish_after=6, cancel_after_open={"gone"})
    async with running(draft, verifier) as h:
        await h.queue.put(request("gone", [12, 40, 77], temperature=0.0, max_tokens=6))
        await h.queue.put(request("stays", [9, 9, 130], temperature=0.0, max_tokens=6))
        await h.wait_for(lambda: len(h.queue.acked) == 2)
    assert h.ended["gone"].finish_reason == "cancelled"
    assert h.ended["gone"].generated == 0
    assert len([d for d in verifier.drafts if d.request_id == "gone"]) <= 1  # at most the one in flight
    assert h.ended["stays"].finish_reason == "length"
    assert h.queue.in_flight() == 0


@pytest.mark.asyncio
async def test_open_errors_busy_retries_and_duplicates(draft: LoadedModel) -> None:
    verifier = ScriptedVerifier(draft, finish_after=3, busy_first={"busy"},
                                open_errors={"dup": "duplicate", "bad": "invalid", "odd": "internal"})
    async with running(draft, verifier, max_sessions=4) as h:
        for rid in ("busy", "dup", "bad", "odd"):
            await h.queue.put(request(rid, [12, 40, 77], temperature=0.0, max_tokens=3))
        await h.wait_for(lambda: len(h.queue.acked) == 4)
    assert verifier.opens.count("busy") == 2  # retried after "busy", then served
    assert h.ended["busy"].finish_reason == "length" and h.ended["busy"].generated == 3
    assert {rid: h.ended[rid].stats.rounds for rid in ("dup", "bad", "odd")} == {"dup": 0, "bad": 0, "odd": 0}
    assert h.queue.in_flight() == 0 and await h.queue.depth() == 0


@pytest.mark.asyncio
async def test_link_drop_releases_reconnects_and_acks_the_duplicate(draft: LoadedModel) -> None:
    verifier = ScriptedVerifier(draft, finish_after=4, drop_after_first_draft=True)
    async with running(draft, verifier) as h:
        await h.queue.put(request("r1", [12, 40, 77], temperature=0.0, max_tokens=4))
        await h.wait_for(lambda: len(h.queue.acked) == 1)
    assert len(verifier.hellos) == 2  # reconnected
    assert h.queue.releases >= 1  # the unacked delivery went back to the queue (no ack at the drop)...
    assert verifier.opens == ["r1", "r1"]  # ...came back, was re-opened, and answered "duplicate"
    [acked] = h.queue.acked  # r1's delivery, the queue's first: "<instance>-1"
    assert acked.endswith("-1") and h.ended["r1"].finish_reason == "duplicate"
    assert h.queue.in_flight() == 0 and await h.queue.depth() == 0


@pytest.mark.asyncio
async def test_bad_tokenizer_refusal_is_fatal(draft: LoadedModel) -> None:
    verifier = ScriptedVerifier(draft, refuse="bad_tokenizer")
    server = await serve(verifier.handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = drafter_config(f"ws://127.0.0.1:{port}/v1/drafter")
    try:
        with pytest.raises(LinkRefused, match="bad_tokenizer") as info:
            await asyncio.wait_for(serve_drafter(cfg, queue=RecordingQueue(), model=draft), TIMEOUT_S)
        assert info.value.fatal
        assert len(verifier.hellos) == 1  # no pointless retries
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """main() routes the root logger to JSON on stderr; put pytest's setup back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("restore_logging")
def test_main_exits_2_when_the_verifier_refuses_the_tokenizer(draft_dir: Path, draft: LoadedModel) -> None:
    verifier = ScriptedVerifier(draft, refuse="bad_tokenizer")
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, Server] = {}

    async def start() -> None:
        holder["server"] = await serve(verifier.handler, "127.0.0.1", 0)
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    try:
        assert started.wait(TIMEOUT_S)
        port = holder["server"].sockets[0].getsockname()[1]
        argv = ["--model", str(draft_dir), "--verifier-url", f"ws://127.0.0.1:{port}/v1/drafter",
                "--queue-url", "memory://", "--log-level", "error"]
        assert main(argv) == 2
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(TIMEOUT_S)
        loop.run_until_complete(_close(holder["server"]))
        loop.close()


async def _close(server: Server) -> None:
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize(("argv", "message"), [
    (["--draft-mode", "beam"], "--draft-mode must be one of sampled, greedy"),
    (["--q-mass", "0"], "--q-mass must be in (0, 1], got 0.0"),
    (["--q-max-entries", "5000"], "--q-max-entries must be in [1, 4096], got 5000"),
])
def test_main_exits_2_on_bad_flags(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main([*argv, "--model", "x"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.asyncio
async def test_http_401_at_the_handshake_is_fatal_and_says_what_to_fix(draft: LoadedModel) -> None:
    def reject(conn: ServerConnection, request: Request) -> Response:
        return Response(401, "Unauthorized", Headers([("Content-Length", "0")]), b"")

    verifier = ScriptedVerifier(draft)
    server = await serve(verifier.handler, "127.0.0.1", 0, process_request=reject)
    port = server.sockets[0].getsockname()[1]
    hello = Hello(role="drafter", node_id="d", protocol_version=PROTOCOL_VERSION, tokenizer_fingerprint="f")
    try:
        with pytest.raises(LinkRefused) as info:
            await VerifierLink(f"ws://127.0.0.1:{port}/v1/drafter", hello, "wrong").connect()
        assert info.value.fatal and info.value.code == "unauthorized"
        assert "--auth-token" in str(info.value)
    finally:
        server.close()
        await server.wait_closed()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.asyncio
async def test_drafter_retries_until_the_verifier_comes_up(draft: LoadedModel) -> None:
    port = free_port()
    url = f"ws://127.0.0.1:{port}/v1/drafter"
    hello = Hello(role="drafter", node_id="d", protocol_version=PROTOCOL_VERSION, tokenizer_fingerprint="f")
    with pytest.raises(LinkDown, match="cannot reach the verifier"):
        await VerifierLink(url, hello).connect()
    queue = RecordingQueue()
    await queue.put(request("late", [12, 40, 77], temperature=0.0, max_tokens=3))
    ready = asyncio.Event()
    task = asyncio.create_task(serve_drafter(drafter_config(url), ready, queue=queue, model=draft))
    await asyncio.sleep(0.2)  # a few failed attempts
    assert not ready.is_set()
    verifier = ScriptedVerifier(draft, finish_after=3)
    server = await serve(verifier.handler, "127.0.0.1", port)
    try:
        await asyncio.wait_for(ready.wait(), TIMEOUT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while not queue.acked:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert verifier.committed["late"][3:] and len(verifier.hellos) == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        server.close()
        await server.wait_closed()
