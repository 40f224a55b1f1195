"""Two coordinators share one Redis; one is killed (SIGKILL) with 20 streams in flight.

* every client reconnects to the other coordinator (SSE with ``Last-Event-ID``, WebSocket with a
  ``resume`` frame) and gets the rest of its stream: all 20 complete token-identical to
  target-only greedy decoding, with no chunk repeated or skipped, and the verifier generated each
  token once (the requests still queued in Redis when their coordinator died included);
* no queue entry stays pending: the stream's pending list drains to empty;
* resuming what cannot be resumed gets a clear 4xx and disturbs nothing: an unknown id, garbage,
  another API key's stream, a position past the end, one that expired; an ``Idempotency-Key``
  retry gets the first answer, not a second generation; ``DELETE /v1/streams/<id>`` stops one.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import websockets

from shared.fleet import Fleet
from shared.models import LoadedModel, load_model
from tests.conftest import free_port, greedy_reference
from tests.e2e.greedy_streams import check_greedy, greedy_body
from tests.e2e.resuming_clients import HEADERS, Resumed, sse_resuming, ws_resuming
from tests.e2e.stack import StackSpec, run_stack
from tests.e2e.test_full_stack import prompt_ids

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.redis]

N_SSE = N_WS = 10
MAX_TOKENS = 96
STREAM = "specfleet:coordinator-kill"
GRACE_S = 8.0
OTHER_KEY = {"Authorization": "Bearer other-key"}


def body(tag: str, i: int) -> dict[str, Any]:
    return greedy_body(tag, i, MAX_TOKENS, "class {tag}{i}(")


def second_coordinator(fleet: Fleet, port: int) -> str:
    """Start another coordinator process on the same Redis; its base URL once ready."""
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


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/stream"


def check_ws_greedy(target: LoadedModel, frames: list[dict[str, Any]], results: list[Resumed]) -> None:
    for frame, got in zip(frames, results, strict=True):
        ids = prompt_ids(target, {"kind": "completion", **frame})
        assert got.token_ids == greedy_reference(target.model, ids, MAX_TOKENS, set()), frame["prompt"]
        assert got.finish_reason == "length"


@pytest.mark.timeout(300)
def test_a_killed_coordinators_clients_resume_through_the_other_and_lose_nothing(
        tiny_models: dict[str, Path], redis_url: str, tmp_path: Path) -> None:
    target = load_model(tiny_models["target"])
    spec = StackSpec(drafts=[tiny_models["draft-L2"]], draft_mode="greedy", draft_len=3, max_sessions=4,
                     redis_url=redis_url, extra_drafter=["--queue-stream", STREAM],
                     extra_coordinator=["--queue-stream", STREAM, "--api-keys", "test-key,other-key",
                                        "--log-level", "info"],
                     extra_verifier=["--orphan-grace-s", str(GRACE_S), "--log-level", "info"])
    sse_bodies = [body("S", i) for i in range(N_SSE)]
    ws_frames = [{"kind": "completion", **{k: v for k, v in body("W", i).items() if k != "stream"}}
                 for i in range(N_WS)]
    with run_stack(tiny_models["target"], spec, tmp_path) as fleet:
        base_b = second_coordinator(fleet, free_port())
        victim = next(c for c in fleet.supervisor.children if c.name == "coordinator")
        before = generated_tokens(fleet)

        async def run() -> tuple[list[Resumed], list[Resumed]]:
            seen = [0]
            sse = [asyncio.create_task(sse_resuming([fleet.base_url, base_b], b, seen)) for b in sse_bodies]
            ws = [asyncio.create_task(ws_resuming([ws_url(fleet.base_url), ws_url(base_b)], f, seen))
                  for f in ws_frames]
            while seen[0] < 20:  # the first requests are being served, the rest still queued in Redis
                await asyncio.sleep(0.02)
            os.kill(victim.proc.pid, signal.SIGKILL)
            return list(await asyncio.gather(*sse)), list(await asyncio.gather(*ws))

        sse_out, ws_out = asyncio.run(run())
        check_greedy(target, sse_bodies, [r.text for r in sse_out])
        check_ws_greedy(target, ws_frames, ws_out)
        resumed = [r.resumes for r in sse_out + ws_out]
        print(f"resumes per client: {resumed}")
        assert all(n >= 1 for n in resumed), "every client lost its coordinator and resumed"
        generated = generated_tokens(fleet) - before
        again = [ln for ln in (tmp_path / "coordinator-b.log").read_text().splitlines() if "made again" in ln]
        assert generated == (N_SSE + N_WS) * MAX_TOKENS, f"the verifier generated some tokens twice (or never): {again}"
        assert wait_drained(redis.Redis.from_url(redis_url), 60) == 0, "queue entries stayed pending"
        assert "coordinator gone; its requests kept for a resume" in (tmp_path / "verifier.log").read_text()
        asyncio.run(bad_resumes(base_b, fleet))


async def bad_resumes(base: str, fleet: Fleet) -> None:
    """Every resume that cannot be served gets a clear 4xx in the OpenAI error shape; then the
    coordinator still serves, and an Idempotency-Key retry is answered without a new generation."""
    short = {**body("X", 0), "max_tokens": 8}
    async with httpx.AsyncClient(base_url=base, timeout=60, headers=HEADERS) as http:
        done = await sse_resuming([base], short)
        async with http.stream("POST", "/v1/completions", json=short) as resp:
            last_id = [line[4:] async for line in resp.aiter_lines() if line.startswith("id: ")][-1]
        rid, position = last_id.rsplit(".", 1)
        cases = [({"Last-Event-ID": "0" * 32 + ".3"}, 404, "stream_not_found"),
                 ({"Last-Event-ID": "hello"}, 400, "invalid_last_event_id"),
                 ({"Last-Event-ID": last_id, **OTHER_KEY}, 404, "stream_not_found"),
                 ({"Last-Event-ID": f"{rid}.{int(position) + 50}"}, 400, "invalid_last_event_id"),
                 ({"Last-Event-ID": f"{rid}.1.1"}, 400, "invalid_last_event_id")]
        for headers, status, code in cases:
            resp = await http.post("/v1/completions", json=short, headers=headers)
            assert (resp.status_code, resp.json()["error"]["code"]) == (status, code), (headers, resp.text)
        again = await http.post("/v1/completions", json=short, headers={"Last-Event-ID": f"{rid}.2"})
        assert again.status_code == 200 and "data: [DONE]" in again.text  # within the grace: resumable
        plain = {**short, "stream": False}
        before = generated_tokens(fleet)
        first = await http.post("/v1/completions", json=plain, headers={"Idempotency-Key": "order-17"})
        retry = await http.post("/v1/completions", json=plain, headers={"Idempotency-Key": "order-17"})
        assert first.status_code == retry.status_code == 200 and first.json() == retry.json()
        assert first.json()["choices"][0]["text"] == done.text
        assert generated_tokens(fleet) - before == 8, "the retry generated again"
        await cancel_for_good(http)
        await asyncio.sleep(GRACE_S + 1)  # the verifier forgets the finished stream
        expired = await http.post("/v1/completions", json=short, headers={"Last-Event-ID": last_id})
        assert (expired.status_code, expired.json()["error"]["code"]) == (404, "stream_not_found"), expired.text
    await ws_unknown(ws_url(base))


async def cancel_for_good(http: httpx.AsyncClient) -> None:
    """A client that leaves a stream for good stops it with DELETE /v1/streams/<id>."""
    long = {**body("X", 1), "max_tokens": 480}
    async with http.stream("POST", "/v1/completions", json=long) as resp:
        first_id = await anext(line[4:] async for line in resp.aiter_lines() if line.startswith("id: "))
    rid = first_id.rsplit(".", 1)[0]  # gone: the request is released, decoded on for the grace
    stopped = await http.delete(f"/v1/streams/{rid}")
    assert stopped.status_code == 200 and stopped.json()["cancelled"] is True, stopped.text
    assert (await http.delete(f"/v1/streams/{'0' * 32}")).status_code == 404
    assert (await http.delete(f"/v1/streams/{rid}", headers=OTHER_KEY)).status_code == 404
    after = await http.post("/v1/completions", json=long, headers={"Last-Event-ID": first_id})
    assert "cancelled" in after.text, after.text[-500:]


async def ws_unknown(url: str) -> None:
    async with websockets.connect(url, additional_headers=HEADERS) as ws:
        await ws.send(json.dumps({"type": "resume", "request_id": "0" * 32, "index": 3}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["error"]["code"] == "stream_not_found", error
