"""Per-drafter credentials: identities, session ownership and revocation without a restart.

The verifier runs in-process on a real loopback socket; the queue link under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import websockets

from services.coordinator.config import CoordinatorConfig
from services.verifier.config import VerifierConfig
from services.verifier.main import serve
from shared.config import describe, from_flags
from shared.credentials import Credentials, CredentialsError, Identity, parse_file, sha256_hex
from shared.log import redact
from shared.models import load_model
from shared.protocol import (
    PROTOCOL_VERSION,
    CloseSession,
    Draft,
    ErrorFrame,
    Hello,
    OpenSession,
    QueueAck,
    Refused,
    SessionOpened,
    Verdict,
    Welcome,
    decode,
    encode,
)
from shared.queue import QueueError
from shared.queue_link import QueueLinkClient
from shared.queue_memory import MemoryQueue
from tests.conftest import free_port, greedy_reference
from tests.integration.test_queue_link import request
from tests.integration.test_queue_link import serve as serve_queue
from tests.integration.test_verifier import GREEDY, Running, collect_text, connect, drive_session, noisy_oracle

SHARED = "shared-token"
TOKENS = {"drafter-a": "token-a", "drafter-b": "token-b"}


def write_creds(path: Path, names: list[str]) -> None:
    entries = [{"id": n, "token_sha256": sha256_hex(TOKENS[n])} for n in names]
    path.write_text(json.dumps({"drafters": entries}))


@pytest_asyncio.fixture
async def verifier(tiny_models: dict[str, Path], tmp_path: Path) -> AsyncIterator[tuple[Running, Path]]:
    creds = tmp_path / "credentials.json"
    write_creds(creds, ["drafter-a", "drafter-b"])
    port = free_port()
    cfg = from_flags(VerifierConfig, port=port, model=str(tiny_models["target"]), auth_token=SHARED, draft_len=3,
                         draft_timeout_s=1.5, credentials_file=str(creds),
                         resume_grace_s=0.0)  # scripted drafters, with no coordinator to send ResumeDone
    ready = asyncio.Event()
    task = asyncio.create_task(serve(cfg, ready))
    await asyncio.wait_for(ready.wait(), 60)
    yield Running(f"ws://127.0.0.1:{port}", load_model(tiny_models["target"])), creds
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_credentials_file_parsing(tmp_path: Path) -> None:
    table = parse_file(json.dumps({"drafters": [{"id": "x", "token": "t"},
                                                {"id": "y", "token_sha256": sha256_hex("u"), "trusted": True}]}), "f")
    assert table[sha256_hex("t")] == Identity("x", False, sha256_hex("t"))
    assert table[sha256_hex("u")].trusted is True
    for bad, why in [("[]", "drafters"), ('{"drafters": [{"id": "x"}]}', "token"),
                     ('{"drafters": [{"id": "x", "token": "t", "trusted": "yes"}]}', "trusted"),
                     ('{"drafters": [{"id": "x", "token": "t"}, {"id": "y", "token": "t"}]}', "share a token"),
                     ("{nope", "JSON")]:
        with pytest.raises(CredentialsError, match=why):
            parse_file(bad, "f")
    path = tmp_path / "c.json"
    write_creds(path, ["drafter-a"])
    creds = Credentials(SHARED, str(path))
    assert creds.authenticate("Bearer token-a", "drafter") == Identity("drafter-a", False, sha256_hex("token-a"))
    assert creds.authenticate(f"Bearer {SHARED}", "drafter") is None  # the shared token no longer admits drafters
    assert creds.authenticate(f"Bearer {SHARED}", "frontend") == Identity(None)
    assert creds.authenticate("Bearer token-a", "frontend") is None
    path.write_text("{broken")  # a broken file is reported and ignored: the last good one stays
    assert not creds.refresh(force=True) and creds.authenticate("Bearer token-a", "drafter") is not None
    shared = Credentials(SHARED)
    assert shared.authenticate(f"Bearer {SHARED}", "drafter") == Identity(None)
    assert shared.authenticate("Bearer nope", "drafter") is None
    assert Credentials().authenticate(None, "drafter") == Identity(None)  # auth off


@pytest.mark.asyncio
async def test_identity_ownership_and_revocation(verifier: tuple[Running, Path]) -> None:
    running, creds = verifier
    url, fp = running.url, running.target.fingerprint
    for token in (SHARED, "not-a-token"):  # neither the shared token nor a stranger's admits a drafter
        with pytest.raises(websockets.InvalidStatus) as info:
            async with connect(url, "drafter", fp, token=token, node_id="drafter-a"):
                pass
        assert info.value.response.status_code == 401
    async with connect(url, "drafter", fp, token=TOKENS["drafter-a"], node_id="drafter-b") as impostor:
        refused = await impostor.recv(Refused)
        assert refused.code == "unauthorized" and "--node-id drafter-a" in refused.message

    prompt = [3, 90, 91, 92]
    ref = greedy_reference(running.target.model, prompt, GREEDY.max_tokens, running.target.eos_ids)
    async with (connect(url, "frontend", token=SHARED) as fe,
                connect(url, "drafter", fp, token=TOKENS["drafter-a"], node_id="drafter-a") as a,
                connect(url, "drafter", fp, token=TOKENS["drafter-b"], node_id="drafter-b") as b):
        await a.recv(Welcome)
        await b.recv(Welcome)
        await a.send(OpenSession(request_id="victim", prompt_ids=prompt, params=GREEDY, origin="test-frontend"))
        opened = await a.recv(SessionOpened, rid="victim")
        for rnd in range(3):  # b's drafts, close and re-open for a's session are refused, with reasons
            await b.send(Draft(request_id="victim", round=rnd, token_ids=[7, 7, 7]))
            err = await b.recv(ErrorFrame, rid="victim")
            assert err.code == "not_owner" and "belongs to another drafter" in err.message
        await b.send(CloseSession(request_id="victim"))
        assert (await b.recv(ErrorFrame, rid="victim")).code == "not_owner"
        await b.send(OpenSession(request_id="victim", prompt_ids=prompt, params=GREEDY, origin="test-frontend"))
        assert (await b.recv(ErrorFrame, rid="victim")).code == "duplicate"
        committed: list[int] = []
        rnd, budget, propose = 0, opened.draft_budget, noisy_oracle(ref, len(prompt), 3)
        while True:  # a drives its session to the end
            await a.send(Draft(request_id="victim", round=rnd, token_ids=propose(prompt + committed, budget)))
            verdict = await a.recv(Verdict, rid="victim")
            committed += verdict.token_ids
            if verdict.finished:
                break
            rnd, budget = rnd + 1, verdict.draft_budget
        assert committed == ref  # the victim's output is undisturbed
        assert (await collect_text(fe, "victim"))[0] == ref

        write_creds(creds, ["drafter-a"])  # revoke b, no restart
        deadline = time.monotonic() + 10
        while not b.ws.close_code:
            assert time.monotonic() < deadline, "the revoked drafter was not disconnected"
            await asyncio.sleep(0.05)
        assert b.ws.close_code == 1008
        committed, _ = await drive_session(a, "after", prompt, GREEDY, noisy_oracle(ref, len(prompt), 4))
        assert committed == ref  # a is unaffected
    with pytest.raises(websockets.InvalidStatus):
        async with connect(url, "drafter", fp, token=TOKENS["drafter-b"], node_id="drafter-b"):
            pass


@pytest.mark.asyncio
async def test_queue_link_identity_and_ack_ownership(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    write_creds(path, ["drafter-a", "drafter-b"])
    queue = MemoryQueue()
    async with serve_queue(queue, Credentials(SHARED, str(path))) as url:  # type: ignore[arg-type]
        with pytest.raises(QueueError, match=r"refused the queue link \(unauthorized\)"):
            await QueueLinkClient(url, SHARED).get("drafter-a", 1, 2.0)
        a, b = QueueLinkClient(url, TOKENS["drafter-a"]), QueueLinkClient(url, TOKENS["drafter-b"])
        await queue.put(request(1))
        await queue.put(request(2))
        got = await a.get("drafter-a", 1, 5.0)
        assert [d.request.request_id for d in got] == ["r1"]
        # b may not ACK a's delivery, nor one still waiting in the queue: both would lose a request
        auth = {"Authorization": f"Bearer {TOKENS['drafter-b']}"}
        async with websockets.connect(url, additional_headers=auth) as raw:
            await raw.send(encode(Hello(role="drafter", node_id="drafter-b", protocol_version=PROTOCOL_VERSION)))
            assert isinstance(decode(await raw.recv()), Welcome)
            waiting = got[0].delivery_id.rpartition("-")[0] + "-2"  # r2's id in this queue: "<instance>-2"
            for delivery_id in (got[0].delivery_id, waiting):
                await raw.send(encode(QueueAck(delivery_id=delivery_id)))
                err = decode(await raw.recv())
                assert isinstance(err, ErrorFrame) and err.code == "not_owner", err
        assert queue.in_flight() == 1 and await queue.depth() == 1
        await a.ack("drafter-a", got[0].delivery_id)
        assert [d.request.request_id for d in await b.get("drafter-b", 1, 5.0)] == ["r2"]
        write_creds(path, ["drafter-b"])  # revoke a: its link closes, and it cannot reopen one
        await asyncio.sleep(1.5)
        with pytest.raises(QueueError, match=r"refused the queue link \(unauthorized\).*unknown or revoked"):
            await a.get("drafter-a", 1, 3.0)
        await a.close()
        await b.close()
    await queue.close()


def test_start_up_log_masks_every_secret() -> None:
    cfg = from_flags(CoordinatorConfig, redis_url="redis://default:hunter2@redis:6379/0",
                     api_key="k1", api_keys="k2,k3",
                            auth_token="t1", max_in_flight=7)
    out = describe(cfg)
    assert (out["api_key"], out["api_keys"], out["auth_token"]) == ("***", "***", "***")
    assert out["redis_url"] == "redis://default:***@redis:6379/0" and out["max_in_flight"] == 7
    assert "hunter2" not in json.dumps(out) and describe(from_flags(CoordinatorConfig))["api_key"] == ""
    assert redact('{"msg": "< authorization: Bearer abc.def-1"}') == '{"msg": "< authorization: Bearer ***"}'
