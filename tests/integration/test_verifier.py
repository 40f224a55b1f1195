"""The verifier on a real loopback socket, driven by scripted drafter/frontend peers."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import websockets
from websockets.asyncio.client import ClientConnection

from services.verifier.config import VerifierConfig
from services.verifier.core import TorchCore
from services.verifier.core_api import CoreDied
from services.verifier.main import serve
from services.verifier.scheduler import Step
from shared.config import from_flags
from shared.models import LoadedModel, load_model
from shared.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Draft,
    ErrorFrame,
    FleetStatus,
    Hello,
    Message,
    OpenSession,
    Refused,
    SamplingParams,
    SessionOpened,
    TokenEvent,
    Verdict,
    Welcome,
    decode,
    encode,
    unpack,
)
from tests.conftest import free_port, greedy_reference

TOKEN = "s3cret"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@dataclass
class Running:
    url: str
    target: LoadedModel


@contextlib.asynccontextmanager
async def serving(tiny_models: dict[str, Path], **settings: Any) -> AsyncIterator[Running]:
    """A real verifier on a free loopback port, in this event loop, with these VerifierConfig settings."""
    port = free_port()
    cfg = from_flags(VerifierConfig, port=port, model=str(tiny_models["target"]), auth_token=TOKEN, **settings)
    ready = asyncio.Event()
    task = asyncio.create_task(serve(cfg, ready))
    await asyncio.wait_for(ready.wait(), 60)
    try:
        yield Running(f"ws://127.0.0.1:{port}", load_model(tiny_models["target"]))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest_asyncio.fixture
async def verifier(tiny_models: dict[str, Path]) -> AsyncIterator[Running]:
    # scripted drafters, often with no frontend
    async with serving(tiny_models, draft_len=3, draft_timeout_s=1.5, resume_grace_s=0.0) as running:
        yield running


class Peer:
    """A scripted peer: a reader task routes frames by request_id into per-session queues."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.inbox: dict[str, asyncio.Queue[Message]] = {}
        self.control: asyncio.Queue[Message] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for raw in self.ws:
                for msg in unpack(decode(raw)):
                    rid = getattr(msg, "request_id", None)
                    (self.box(rid) if rid else self.control).put_nowait(msg)

    def box(self, rid: str) -> asyncio.Queue[Message]:
        return self.inbox.setdefault(rid, asyncio.Queue())

    async def send(self, msg: Message) -> None:
        await self.ws.send(encode(msg))

    async def recv(self, *types: type, rid: str | None = None, timeout: float = 60) -> Any:
        """Next frame of one of ``types`` (others, like periodic FleetStatus, are skipped)."""
        queue = self.box(rid) if rid else self.control
        while True:
            msg = await asyncio.wait_for(queue.get(), timeout)
            if not types or isinstance(msg, types):
                return msg


@contextlib.asynccontextmanager
async def connect(url: str, role: str, fingerprint: str = "", token: str = TOKEN,
                  node_id: str = "") -> AsyncIterator[Peer]:
    path = "/v1/drafter" if role == "drafter" else "/v1/frontend"
    headers = {"Authorization": f"Bearer {token}"}
    async with websockets.connect(url + path, additional_headers=headers) as ws:
        peer = Peer(ws)
        await peer.send(Hello(role=role, node_id=node_id or f"test-{role}",  # type: ignore[arg-type]
                              protocol_version=PROTOCOL_VERSION, tokenizer_fingerprint=fingerprint, model="test"))
        yield peer
        peer._reader.cancel()


async def drive_session(peer: Peer, rid: str, prompt: list[int], params: SamplingParams,
                        propose: Any, stop_after_rounds: int | None = None) -> tuple[list[int], int]:
    """Play a drafter for one session. ``propose(context, k)`` returns k draft tokens."""
    await peer.send(OpenSession(request_id=rid, prompt_ids=prompt, params=params, origin="test-frontend"))
    opened = await peer.recv(SessionOpened, ErrorFrame, rid=rid)
    assert isinstance(opened, SessionOpened), opened
    committed: list[int] = []
    budget, rnd, accepted = opened.draft_budget, 0, 0
    while stop_after_rounds is None or rnd < stop_after_rounds:
        await peer.send(Draft(request_id=rid, round=rnd, token_ids=propose(prompt + committed, budget)))
        verdict = await peer.recv(Verdict, rid=rid)
        assert verdict.round == rnd
        committed += verdict.token_ids
        accepted += verdict.accepted
        if verdict.finished:
            break
        budget, rnd = verdict.draft_budget, rnd + 1
    return committed, accepted


async def collect_text(fe: Peer, rid: str) -> tuple[list[int], str, TokenEvent]:
    ids: list[int] = []
    text = ""
    while True:
        ev = await fe.recv(TokenEvent, rid=rid)
        ids += ev.token_ids
        text += ev.text
        if ev.finished:
            return ids, text, ev


def noisy_oracle(reference: list[int], prompt_len: int, seed: int) -> Any:
    """Drafts the true continuation, corrupting each token with probability 0.3."""
    rng = random.Random(seed)

    def propose(context: list[int], k: int) -> list[int]:
        pos = len(context) - prompt_len
        true = reference[pos : pos + k]
        return [t if rng.random() > 0.3 else rng.randrange(5, 300) for t in true]

    return propose


@pytest.mark.asyncio
async def test_handshakes_and_refusals(verifier: Running) -> None:
    async with connect(verifier.url, "frontend") as fe:
        welcome = await fe.recv(Welcome)
        assert welcome.tokenizer_fingerprint == verifier.target.fingerprint
        assert isinstance(await fe.recv(FleetStatus), FleetStatus)
    async with connect(verifier.url, "drafter", fingerprint="not-the-target") as bad:
        refused = await bad.recv(Refused)
        assert refused.code == "bad_tokenizer" and "tokenizer" in refused.message
    with pytest.raises(websockets.InvalidStatus) as info:
        async with connect(verifier.url, "drafter", token="wrong"):
            pass
    assert info.value.response.status_code == 401


@pytest.mark.asyncio
async def test_greedy_sessions_match_target_only_and_batch(verifier: Running) -> None:
    model, fp = verifier.target.model, verifier.target.fingerprint
    prompts = [[3, *random.Random(i).sample(range(5, 300), 4 + i)] for i in range(6)]
    refs = [greedy_reference(model, p, GREEDY.max_tokens, verifier.target.eos_ids) for p in prompts]
    async with connect(verifier.url, "drafter", fp) as peer, connect(verifier.url, "frontend") as fe:
        await peer.recv(Welcome)
        outs = await asyncio.gather(*[
            drive_session(peer, f"g{i}", p, GREEDY, noisy_oracle(refs[i], len(p), i)) for i, p in enumerate(prompts)
        ])
        streamed = [await collect_text(fe, f"g{i}") for i in range(len(prompts))]
    for (committed, accepted), ref, (ids, text, last) in zip(outs, refs, streamed, strict=True):
        assert committed == ref == ids
        assert 0 < accepted < len(ref)  # partial acceptance was exercised
        assert text == verifier.target.tokenizer.decode(ref, skip_special_tokens=True)
        assert last.completion_tokens == len(ref) and last.accepted_tokens == accepted


@pytest.mark.asyncio
async def test_autonomous_session_and_drafter_loss_fallback(verifier: Running) -> None:
    model, fp = verifier.target.model, verifier.target.fingerprint
    prompt = [3, 40, 41, 42, 43]
    ref = greedy_reference(model, prompt, GREEDY.max_tokens, verifier.target.eos_ids)
    async with connect(verifier.url, "frontend") as fe:
        await fe.send(OpenSession(request_id="auto", prompt_ids=prompt, params=GREEDY, origin="test-frontend",
                                  speculative=False))
        assert (await collect_text(fe, "auto"))[0] == ref
        async with connect(verifier.url, "drafter", fp) as peer:  # the drafter dies after two rounds
            await peer.recv(Welcome)
            partial, _ = await drive_session(peer, "lost", prompt, GREEDY, noisy_oracle(ref, len(prompt), 0),
                                             stop_after_rounds=2)
        ids, _, last = await collect_text(fe, "lost")
        assert ids == ref and ids[: len(partial)] == partial and last.finish_reason == "length"


@pytest.mark.asyncio
async def test_stop_string_cancel_duplicate_and_bad_requests(verifier: Running) -> None:
    tok, fp = verifier.target.tokenizer, verifier.target.fingerprint
    prompt = [3, 50, 51, 52]
    ref = greedy_reference(verifier.target.model, prompt, 40, verifier.target.eos_ids)
    full = tok.decode(ref, skip_special_tokens=True)
    stop = full[10:13]
    async with connect(verifier.url, "frontend") as fe:
        params = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop])
        await fe.send(OpenSession(request_id="stop", prompt_ids=prompt, params=params, origin="test-frontend",
                                  speculative=False))
        _, text, last = await collect_text(fe, "stop")
        assert text == full[: full.index(stop)] and last.finish_reason == "stop"
        await fe.send(OpenSession(request_id="stop", prompt_ids=prompt, params=params, origin="test-frontend",
                                  speculative=False))
        assert (await fe.recv(ErrorFrame, rid="stop")).code == "duplicate"
        too_long = SamplingParams(temperature=0.0, max_tokens=10_000)
        await fe.send(OpenSession(request_id="big", prompt_ids=prompt, params=too_long, origin="test-frontend"))
        assert (await fe.recv(ErrorFrame, rid="big")).code == "invalid"
        async with connect(verifier.url, "drafter", fp) as peer:
            await peer.recv(Welcome)
            await peer.send(OpenSession(request_id="c", prompt_ids=prompt, params=GREEDY, origin="test-frontend"))
            await peer.recv(SessionOpened, rid="c")
            await fe.send(Cancel(request_id="c"))
            verdict = await peer.recv(Verdict, rid="c")
            assert verdict.finished and verdict.finish_reason == "cancelled"
            await peer.send(Draft(request_id="c", round=0, token_ids=[7]))
            assert (await peer.recv(ErrorFrame, rid="c")).code == "unknown_session"


@pytest.mark.asyncio
async def test_fuzzed_frames_never_stop_the_verifier(verifier: Running) -> None:
    rng = random.Random(1234)
    fp = verifier.target.fingerprint
    valid = encode(Draft(request_id="x", round=0, token_ids=[1, 2, 3]))
    async with connect(verifier.url, "drafter", fp) as peer:
        await peer.recv(Welcome)
        for i in range(1200):
            if i % 2:
                frame = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
            else:
                frame = bytearray(valid)
                for _ in range(rng.randrange(1, 4)):
                    frame[rng.randrange(len(frame))] = rng.randrange(256)
                frame = bytes(frame)
            await peer.ws.send(frame)
        await peer.ws.send("a text frame")
        prompt = [3, 60, 61]
        ref = greedy_reference(verifier.target.model, prompt, GREEDY.max_tokens, verifier.target.eos_ids)
        committed, _ = await drive_session(peer, "after-fuzz", prompt, GREEDY, noisy_oracle(ref, len(prompt), 1))
        assert committed == ref


@pytest.mark.asyncio
async def test_silent_drafter_times_out_to_target_only(verifier: Running) -> None:
    prompt = [3, 70, 71, 72]
    ref = greedy_reference(verifier.target.model, prompt, GREEDY.max_tokens, verifier.target.eos_ids)
    async with connect(verifier.url, "frontend") as fe, connect(verifier.url, "drafter",
                                                                  verifier.target.fingerprint) as peer:
        await peer.recv(Welcome)
        await peer.send(OpenSession(request_id="silent", prompt_ids=prompt, params=GREEDY, origin="test-frontend"))
        await peer.recv(SessionOpened, rid="silent")  # ... and never sends a draft
        ids, _, last = await collect_text(fe, "silent")
    assert ids == ref and last.drafted_tokens == 0


@pytest.mark.asyncio
async def test_tiny_temperature_does_not_fail_its_batch(verifier: Running) -> None:
    prompt = [3, 80, 81]
    async with connect(verifier.url, "frontend") as fe:
        for rid, temp in (("normal", 1.0), ("tiny", 1e-40)):
            await fe.send(OpenSession(request_id=rid, prompt_ids=prompt, origin="test-frontend", speculative=False,
                                      params=SamplingParams(temperature=temp, max_tokens=16, ignore_eos=True)))
        finals = [(await collect_text(fe, rid))[2] for rid in ("normal", "tiny")]
    assert [f.finish_reason for f in finals] == ["length", "length"]


async def open_resumed(peer: Peer, rid: str, prompt: list[int], params: SamplingParams,
                       deadline_s: float = 10.0) -> SessionOpened:
    """Re-open ``rid`` from ``peer``. Until the verifier has seen the old drafter's link close,
    the session still has that drafter and the open is answered "duplicate": retry a little."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while True:
        await peer.send(OpenSession(request_id=rid, prompt_ids=prompt, params=params, origin="test-frontend"))
        reply = await peer.recv(SessionOpened, ErrorFrame, rid=rid)
        if isinstance(reply, SessionOpened):
            return reply
        assert reply.code == "duplicate" and loop.time() < deadline, reply
        await asyncio.sleep(0.005)


@pytest.mark.asyncio
async def test_another_drafter_resumes_a_session_whose_drafter_left(verifier: Running) -> None:
    """Drafter A plays round 0 and drops its link; the session goes on target-only until drafter B
    re-opens it: B gets the committed tokens and the round to draft for, drafts, and gets the
    verdicts. The client sees one greedy decoding of the target, nothing lost or repeated."""
    fp = verifier.target.fingerprint
    prompt = [3, 90, 91, 92, 93]
    # long enough that the target-only stretch between A leaving and B resuming cannot finish it
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    ref = greedy_reference(verifier.target.model, prompt, params.max_tokens, set())
    async with connect(verifier.url, "frontend") as fe, connect(verifier.url, "drafter", fp,
                                                                  node_id="drafter-b") as b:
        await b.recv(Welcome)
        async with connect(verifier.url, "drafter", fp, node_id="drafter-a") as a:
            await a.recv(Welcome)
            played, _ = await drive_session(a, "resume", prompt, params, noisy_oracle(ref, len(prompt), 5),
                                            stop_after_rounds=1)
        assert 0 < len(played) < params.max_tokens

        opened = await open_resumed(b, "resume", prompt, params)
        assert opened.round >= 1 and opened.draft_budget > 0
        committed = list(opened.committed_ids)
        assert len(committed) >= len(played) and committed == ref[: len(committed)]
        assert len(committed) < params.max_tokens, "the session ended before B resumed it: lengthen it"

        rnd, budget, rounds = opened.round, opened.draft_budget, 0
        while True:  # B drafts the true continuation: all accepted, and the session ends quickly
            pos = len(committed)
            await b.send(Draft(request_id="resume", round=rnd, token_ids=ref[pos : pos + budget]))
            verdict = await b.recv(Verdict, rid="resume")
            assert verdict.round == rnd
            assert verdict.accepted == min(budget, len(ref) - pos)
            committed += verdict.token_ids
            rounds += 1
            if verdict.finished:
                break
            rnd, budget = rnd + 1, verdict.draft_budget
        assert rounds >= 1 and verdict.finish_reason == "length"
        ids, text, last = await collect_text(fe, "resume")
    assert committed == ref
    assert ids == ref and last.completion_tokens == len(ref) and last.finish_reason == "length"
    assert text == verifier.target.tokenizer.decode(ref, skip_special_tokens=True)
    assert last.accepted_tokens > 0


@pytest.mark.asyncio
async def test_a_session_whose_drafter_is_connected_cannot_be_taken_over(verifier: Running) -> None:
    fp = verifier.target.fingerprint
    prompt = [3, 100, 101, 102]
    ref = greedy_reference(verifier.target.model, prompt, GREEDY.max_tokens, verifier.target.eos_ids)
    async with connect(verifier.url, "frontend") as fe, \
            connect(verifier.url, "drafter", fp, node_id="drafter-a") as a, \
            connect(verifier.url, "drafter", fp, node_id="drafter-b") as b:
        await a.recv(Welcome)
        await b.recv(Welcome)
        await a.send(OpenSession(request_id="taken", prompt_ids=prompt, params=GREEDY, origin="test-frontend"))
        opened = await a.recv(SessionOpened, rid="taken")
        assert (opened.committed_ids, opened.round) == ([], 0)  # a fresh session, not a resumed one
        await b.send(OpenSession(request_id="taken", prompt_ids=prompt, params=GREEDY, origin="test-frontend"))
        assert (await b.recv(ErrorFrame, rid="taken")).code == "duplicate"
        await b.send(Draft(request_id="taken", round=0, token_ids=ref[:3]))  # nor may it draft for it
        assert (await b.recv(ErrorFrame, rid="taken")).code == "not_owner"
        # A still owns the session: its rounds go on, and B never hears of them
        committed: list[int] = []
        accepted = 0
        rnd, budget = 0, opened.draft_budget
        while True:
            pos = len(committed)
            await a.send(Draft(request_id="taken", round=rnd, token_ids=ref[pos : pos + budget]))
            verdict = await a.recv(Verdict, rid="taken")
            assert verdict.round == rnd
            committed += verdict.token_ids
            accepted += verdict.accepted
            if verdict.finished:
                break
            rnd, budget = rnd + 1, verdict.draft_budget
        ids, _, _ = await collect_text(fe, "taken")
        assert committed == ids == ref and accepted > 0
        assert b.box("taken").empty()


@pytest.mark.asyncio
async def test_fleet_view_needs_a_frontend_key_and_lists_each_drafter(verifier: Running) -> None:
    fleet_url = verifier.url.replace("ws://", "http://") + "/fleet"
    model, fp = verifier.target.model, verifier.target.fingerprint
    prompt = [3, 50, 51, 52]
    ref = greedy_reference(model, prompt, GREEDY.max_tokens, verifier.target.eos_ids)
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(fleet_url)).status_code == 401
        assert (await http.get(fleet_url, headers={"Authorization": "Bearer wrong"})).status_code == 401
        async with connect(verifier.url, "drafter", fp, node_id="edge-7") as peer, \
                connect(verifier.url, "frontend") as fe:
            await peer.recv(Welcome)
            committed, _ = await drive_session(peer, "f1", prompt, GREEDY, noisy_oracle(ref, len(prompt), 7))
            await collect_text(fe, "f1")
            view = (await http.get(fleet_url, headers={"Authorization": f"Bearer {TOKEN}"})).json()
    assert committed == ref
    assert view["ready"] is True and view["engine"]["backend"] == "torch" and view["engine"]["dtype"] == "float32"
    assert view["totals"]["generated"] >= len(ref) and view["totals"]["steps"] > 0
    # the session decoded after its prompt: cached rows, and the estimator the dashboard prices with
    assert view["totals"]["decode_cached"] >= len(prompt) * view["totals"]["decode_segments"] > 0
    assert set(view["estimator"]) == {"sum_new", "sum_total_x_new", "sum_cached", "const"}
    assert {b for b, _, _ in view["target_only"]} >= {1, 2, 4, 8}  # calibrated at start-up
    at_zero, per_session = view["between_forwards"]  # measured between the session's forwards
    assert at_zero >= 0 and per_session >= 0 and at_zero + per_session > 0
    [row] = [d for d in view["drafters"] if d["node"] == "edge-7"]
    assert row["model"] == "test" and row["trusted"] is True
    assert row["drafted_tokens"] >= row["accepted_tokens"] > 0


@pytest.mark.asyncio
@pytest.mark.parametrize("core_mode", ["thread", "inline"])
async def test_a_core_that_dies_ends_the_verifier(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                  core_mode: str) -> None:
    """An error in a step (injected here) ends ``serve`` with CoreDied, so the process exits and is
    restarted, instead of serving sockets while no step runs (a request's stream would hang)."""

    def broken(self: TorchCore, step: Step, scheduled: float) -> None:
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(TorchCore, "_step", broken)
    port = free_port()
    cfg = from_flags(VerifierConfig, port=port, model=str(tiny_models["target"]), auth_token=TOKEN, core_mode=core_mode)
    ready = asyncio.Event()
    task = asyncio.create_task(serve(cfg, ready))
    await asyncio.wait_for(ready.wait(), 60)
    async with connect(f"ws://127.0.0.1:{port}", "frontend") as fe:
        await fe.send(OpenSession(request_id="doomed", prompt_ids=[3, 40, 41], params=GREEDY, origin="test-frontend",
                                  speculative=False))
        with pytest.raises(CoreDied, match="injected step failure"):
            await asyncio.wait_for(task, 30)
