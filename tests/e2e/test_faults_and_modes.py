"""Target-only serving, and a drafter killed mid-generation: no request is lost or altered."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from shared.models import LoadedModel, load_model
from shared.supervisor import Child, death_report, tail
from tests.conftest import greedy_reference
from tests.e2e.stack import StackSpec, run_stack
from tests.e2e.test_full_stack import prompt_ids, stream_many

pytestmark = pytest.mark.e2e


def bodies(n: int, max_tokens: int) -> list[dict[str, object]]:
    return [{"kind": "completion", "model": "target", "prompt": f"def f{i}(x", "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True} for i in range(n)]


def assert_greedy(target: LoadedModel, sent: list[dict[str, object]], results: list[tuple]) -> None:
    for body, (ids, _, done) in zip(sent, results, strict=True):
        ref = greedy_reference(target.model, prompt_ids(target, body), int(body["max_tokens"]), set())  # type: ignore[call-overload]
        assert ids == ref and done["finish_reason"] == "length"


async def session_opened(drafter: Child, work: asyncio.Task[list[tuple]], timeout_s: float = 60.0) -> None:
    """Wait until ``drafter`` (run with ``drafter_log_level="info"``) logs an opened session:
    the moment to kill or freeze it. On a loaded machine it can take seconds (a second drafter
    may claim the first requests, or the drafter connects late), so this waits long, and it fails
    with the reason rather than letting a kill land on a drafter that holds nothing: the
    requests all ended first (their error, if any, is raised), the drafter died, or the time ran
    out."""
    deadline = time.monotonic() + timeout_s
    while not logged(drafter, "session opened", deadline, f"opened no session within {timeout_s:.0f} s"):
        if work.done():
            work.result()  # raises the requests' error, if they failed
            raise AssertionError(f"every request finished before {drafter.name} opened a session")
        await asyncio.sleep(0.01)


def logged(child: Child, text: str, deadline: float, missing: str) -> bool:
    """Whether ``child``'s log holds ``text`` yet; fails with the reason once the child died, or
    with ``missing`` and its log's end once ``deadline`` (monotonic) passed."""
    if text in child.log_path.read_text(errors="replace"):
        return True
    if not child.alive:
        raise AssertionError(death_report(child))
    if time.monotonic() > deadline:
        raise AssertionError(f"{child.name} {missing}; its log ends:\n{tail(child.log_path)}")
    return False


def wait_logged(children: list[Child], text: str, timeout_s: float = 60.0) -> None:
    """Wait until every child's log holds ``text`` (e.g. each drafter connected to the verifier
    and to the coordinator's queue: the coordinator is ready as soon as one drafter is, and a
    drafter that connects late may find every request claimed by the others)."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        while not logged(child, text, deadline, f"never logged {text!r}"):
            time.sleep(0.05)


def test_target_only_serving_without_drafters(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    target = load_model(tiny_models["target"])
    spec = StackSpec(drafts=[], extra_coordinator=["--speculation", "off"])
    with run_stack(tiny_models["target"], spec, tmp_path) as stack:
        sent = bodies(8, 24)
        results = asyncio.run(stream_many(stack, sent))
    assert_greedy(target, sent, results)
    assert all(done["specfleet"]["drafted_tokens"] == 0 for _, _, done in results)


@pytest.mark.parametrize("kind", ["draft-model", "gguf"])
def test_killed_drafter_loses_no_request(tiny_models: dict[str, Path], tiny_ggufs: dict[str, Path], tmp_path: Path,
                                         kind: str) -> None:
    """SIGKILL one of two drafters while its sessions run: they finish target-only, unchanged. The
    drafters run a draft model, or GGUF drafts on llama.cpp (a copy of the target and a small draft)."""
    target = load_model(tiny_models["target"])
    drafts = [tiny_models["draft-L2"]] * 2 if kind == "draft-model" else [tiny_ggufs["target"], tiny_ggufs["draft-L1"]]
    spec = StackSpec(drafts=drafts, max_sessions=6, draft_len=2, drafter_log_level="info")
    with run_stack(tiny_models["target"], spec, tmp_path) as stack:
        victim = next(c for c in stack.supervisor.children if c.name == "drafter-1")
        drafters = [c for c in stack.supervisor.children if c.name.startswith("drafter")]
        # both links of both drafters: a drafter whose queue link opens late (its first try can
        # come before the coordinator listens, and it retries a second later) finds every
        # request served by the other, as the tiny models finish 12 x 300 tokens in under a second
        wait_logged(drafters, "connected to the verifier")
        wait_logged(drafters, "queue link open")

        async def run() -> list[tuple]:
            work = asyncio.create_task(stream_many(stack, sent))
            await session_opened(victim, work)
            os.kill(victim.proc.pid, signal.SIGKILL)
            return await work

        sent = bodies(12, 300)
        results = asyncio.run(run())
        assert victim.proc.wait(5) == -signal.SIGKILL
        verifier_log = (tmp_path / "verifier.log").read_text()
    assert "sessions continue target-only" in verifier_log, "the kill landed after drafter-1's sessions ended"
    assert_greedy(target, sent, results)


def test_queued_requests_go_target_only_when_the_last_drafter_dies(tiny_models: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    """The only drafter (one session at a time) is killed for good with requests still in the
    queue: after --queue-fallback-s without a drafter the coordinator serves them target-only,
    instead of leaving them to wait for a drafter that may never come."""
    target = load_model(tiny_models["target"])
    spec = StackSpec(drafts=[tiny_models["draft-L2"]], max_sessions=1, draft_len=2, drafter_log_level="info",
                     extra_coordinator=["--queue-fallback-s", "1"])  # the stack's --queue-wait-s 0: only the fallback
    with run_stack(tiny_models["target"], spec, tmp_path) as stack:
        victim = next(c for c in stack.supervisor.children if c.name == "drafter-1")

        async def run() -> list[tuple]:
            work = asyncio.create_task(stream_many(stack, sent))
            await session_opened(victim, work)
            os.kill(victim.proc.pid, signal.SIGKILL)
            return await asyncio.wait_for(work, 120)  # without the fallback the queued ones wait for 600 s

        sent = bodies(4, 200)
        results = asyncio.run(run())
        coordinator_log = (tmp_path / "coordinator.log").read_text()
    assert "queued requests served target-only" in coordinator_log
    assert_greedy(target, sent, results)
    moved = sum(done["specfleet"]["drafted_tokens"] == 0 for _, _, done in results)
    print(f"last drafter killed: {len(results)}/{len(sent)} completed, {moved} never drafted (served target-only)")
    assert moved >= 1


def dropped(verifier_log: Path, node_id: str) -> bool:
    """Whether the verifier's log says it lost ``node_id``'s connection."""
    return any("peer disconnected" in line and f'"{node_id}"' in line for line in verifier_log.read_text().splitlines())


def test_a_frozen_drafter_is_dropped_by_the_keepalive(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A drafter that stops answering without closing its connection (SIGSTOP: the kernel still
    acknowledges its TCP segments, as for a host whose process hangs) is disconnected once its
    WebSocket pong is late, and its sessions finish target-only well before the 30 s draft
    timeout would have let them go on (the verifier fills them while their drafts are late, so
    they may even finish before the keepalive drops the drafter)."""
    target = load_model(tiny_models["target"])
    spec = StackSpec(drafts=[tiny_models["draft-L2"]], draft_len=2, drafter_log_level="info",
                     extra_verifier=["--ws-ping-interval-s", "0.5", "--ws-ping-timeout-s", "3",
                                     "--draft-timeout-s", "30",  # 3 s: room for a loaded coordinator's pongs
                                     "--log-level", "info"])
    with run_stack(tiny_models["target"], spec, tmp_path) as stack:
        victim = next(c for c in stack.supervisor.children if c.name == "drafter-1")

        async def run() -> tuple[list[tuple], float]:
            work = asyncio.create_task(stream_many(stack, sent))
            await session_opened(victim, work)
            os.kill(victim.proc.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            try:
                done = await asyncio.wait_for(work, 20), time.monotonic() - frozen
                while not dropped(tmp_path / "verifier.log", victim.name):
                    assert time.monotonic() - frozen < 10, "the keepalive never dropped the frozen drafter"
                    await asyncio.sleep(0.1)  # still frozen: its 3 s pong timeout runs out
                return done
            finally:
                os.kill(victim.proc.pid, signal.SIGCONT)

        sent = bodies(4, 300)
        results, took = asyncio.run(run())
    print(f"frozen drafter: {len(results)}/{len(sent)} completed {took:.1f} s after the freeze")
    assert_greedy(target, sent, results)
