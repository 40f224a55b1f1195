"""``specfleet up`` end to end: the real services as processes on loopback, tiny models.

This is what ``make run`` does, on free ports so concurrent runs on one machine do not collide.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from shared import cli
from shared.models import load_model
from tests.conftest import free_port, greedy_reference
from tests.e2e.greedy_streams import sample_metric, sample_metric_async
from tests.e2e.resuming_clients import Resumed, ws_resuming
from tests.e2e.test_full_stack import prompt_ids, stream_many

pytestmark = pytest.mark.e2e


def _up(tmp_path: Path, models: dict[str, Path], *flags: str) -> list[str]:
    drafts = f"{models['draft-L1']},{models['draft-L2']}"
    return [sys.executable, "-m", "shared.cli", "up", "--port", "0", "--verifier-port", "0",
            "--target", str(models["target"]), "--drafts", drafts, "--state-dir", str(tmp_path / "state"), *flags]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_make_tiny_models_prints_paths(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tiny_models["target"].parent
    assert cli.main(["make-tiny-models", "--out", str(out_dir)]) == 0  # idempotent: the family exists
    out = capsys.readouterr().out
    assert f"target: {tiny_models['target']}" in out
    assert f"draft-L2: {tiny_models['draft-L2']}" in out


def test_up_smoke_answers_one_request_and_exits_zero(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    proc = subprocess.run(_up(tmp_path, tiny_models, "--smoke"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("verifier", "coordinator", "drafter-1", "drafter-2"):
        assert f"started {name}" in proc.stdout
    assert "smoke: reply" in proc.stdout
    assert re.search(r"smoke: \d+ tokens in [\d.]+ s = [\d.]+ tokens/s", proc.stdout)
    for pid in re.findall(r"pid (\d+)", proc.stdout):
        assert _gone(int(pid)), f"child {pid} outlived specfleet up"


def test_up_runs_until_sigterm_then_stops_every_child(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    proc = subprocess.Popen(_up(tmp_path, tiny_models, "--drafters", "1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        lines = _until_ready(proc)
        assert any("specfleet is ready at http://127.0.0.1:" in line for line in lines), "".join(lines)
        assert any("curl http://127.0.0.1:" in line for line in lines)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)  # reaps it and closes its pipes (else a later test sees them leak)
    assert proc.returncode == 0, "".join(lines) + rest
    assert "stopping every service" in rest
    for pid in re.findall(r"pid (\d+)", "".join(lines)):
        assert _gone(int(pid)), f"child {pid} outlived specfleet up"


def test_up_names_the_service_that_died(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken-target"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    flags = _up(tmp_path, tiny_models, "--drafters", "1", "--ready-timeout", "120")
    flags[flags.index("--target") + 1] = str(broken)
    proc = subprocess.run(flags, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # The verifier and the coordinator both load the broken target; whichever dies first is named.
    named = [svc for svc in ("verifier", "coordinator") if f"{svc} (pid" in proc.stderr]
    assert named, proc.stderr
    assert str(tmp_path / "state" / "logs" / f"{named[0]}.log") in proc.stderr


RESUME_TOKENS = 448  # the tiny models' context is 512
N_RESUME = 20  # requests in flight when the drafter is killed
PER_DRAFTER = 16  # sessions each drafter serves at once


def test_up_restarts_a_killed_drafter_and_resumes_its_sessions(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """kill -9 a drafter with 20 requests in flight: every request completes, greedy output is the
    target's own, a live drafter resumes the victim's sessions (the survivor, or the victim itself
    once restarted: whichever claims them first), and the victim is started again."""
    metrics_port = _two_free_ports()  # drafter-1's; drafter-2's is the next port
    proc = subprocess.Popen(_up(tmp_path, tiny_models, "--drafter-metrics-port", str(metrics_port),
                                "--sessions-per-drafter", str(PER_DRAFTER)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = _until_ready(proc)
        base_url = next(m.group(1) for line in lines if (m := re.search(r"ready at (http://\S+)", line)))
        pids = {int(m.group(1)): int(m.group(2)) for line in lines
                if (m := re.search(r"started drafter-(\d+)\s+pid (\d+)", line))}
        stack = SimpleNamespace(ws_url=base_url.replace("http://", "ws://") + "/v1/stream")
        # long enough that the victim's sessions are still running when the queue hands them on (at
        # 192 tokens the verifier, going on target-only, could finish them before a drafter had room)
        sent = [{"kind": "completion", "model": "target", "prompt": f"def f{i}(x", "max_tokens": RESUME_TOKENS,
                 "temperature": 0, "ignore_eos": True} for i in range(N_RESUME)]

        async def run() -> tuple[int, list[tuple]]:
            work = asyncio.create_task(stream_many(stack, sent))  # type: ignore[arg-type]
            victim = await _busier_drafter_once_it_drafted(metrics_port, work, tmp_path / "state" / "logs")
            os.kill(pids[victim], signal.SIGKILL)
            return victim, await work

        victim, results = asyncio.run(run())
        victim_port = metrics_port + victim - 1
        # the requests may all finish before the supervisor has even noticed the death: wait until
        # the victim serves its metrics again (restarted), so stderr holds the restart and its
        # counters can be read
        deadline = time.monotonic() + 90
        while not _serves(f"http://127.0.0.1:{victim_port}/metrics") and time.monotonic() < deadline:
            time.sleep(0.2)
        resumed = sum(sample_metric(f"http://127.0.0.1:{port}/metrics", "specfleet_drafter_sessions_resumed_total")
                      for port in (metrics_port, metrics_port + 1))  # the restarted victim, the survivor
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)  # reaps it and closes its pipes (else a later test sees them leak)
    target = load_model(tiny_models["target"])
    for body, (ids, _, done) in zip(sent, results, strict=True):
        assert ids == greedy_reference(target.model, prompt_ids(target, body), RESUME_TOKENS, set())
        assert done["finish_reason"] == "length"
    assert "restarting in" in err and f"drafter-{victim}" in err, err
    verifier_log = (tmp_path / "state" / "logs" / "verifier.log").read_text()
    # seen once in a dozen runs on a 2-core host (12-08): no drafter resumed a session; what the verifier logged
    assert resumed >= 1, "\n".join(line for line in verifier_log.splitlines()
                                   if "resum" in line or "gone" in line or "target-only" in line)[-4000:]
    assert "session resumed by a drafter" in verifier_log


async def _busier_drafter_once_it_drafted(metrics_port: int, work: asyncio.Task[Any], logs: Path) -> int:
    """The drafter (1 or 2) holding more of the requests, as soon as it holds at least half of them
    and has played a round. With PER_DRAFTER 16 and N_RESUME 20 the other then holds at most 10, so
    the survivor has room for 6 of the victim's sessions at once. (When this test killed drafter-1
    whatever it held, it now and then saw nothing resumed; with room for all 20 on each drafter it
    saw nothing resumed in 2 of 2 runs. Why was not found.) A later kill can leave nothing to resume
    (the tiny models generate 448 tokens in about 1.5 s here); an earlier one, while its sessions
    only held a slot, nothing committed, so the survivor opened them afresh. (Waiting for all 20 to
    be held at one poll once waited past the requests' end on CI: it now fails as soon as they end,
    with the drafters' logs.)"""
    urls = {n: f"http://127.0.0.1:{metrics_port + n - 1}/metrics" for n in (1, 2)}
    held: dict[int, float] = {}
    deadline = time.monotonic() + 90  # a time limit, not a count: each poll's GETs take longer on a slow host
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline and not work.done():
            held = {n: await sample_metric_async(http, url, "specfleet_drafter_sessions") for n, url in urls.items()}
            busier = max(held, key=lambda n: held[n])
            if (held[busier] >= N_RESUME // 2
                    and await sample_metric_async(http, urls[busier], "specfleet_drafter_rounds_total") > 0):
                return busier
            await asyncio.sleep(0.02)
    tails = "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-15:])
                      for log in sorted(logs.glob("*.log")))
    pytest.fail(f"no drafter held {N_RESUME // 2} of the {N_RESUME} requests with a round played"
                f" ({'the requests ended' if work.done() else 'in 90 s'}): sessions {held}\n{tails}")


def _two_free_ports() -> int:
    """A port p with p and p + 1 both free: drafter-1's and drafter-2's /metrics."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1 in 100 tries")


KILLED_TOKENS = 128
KILLED_STREAMS = [{"kind": "completion", "model": "target", "prompt": f"def k{i}(z", "max_tokens": KILLED_TOKENS,
                   "temperature": 0, "ignore_eos": True} for i in range(20)]


async def _kill_mid_stream(base_url: str, coordinator: int) -> list[Resumed]:
    """20 WebSocket streams on the coordinator; kill -9 it once they are flowing; each client
    reconnects (the same URL: ``specfleet up`` restarts it there) and resumes its stream."""
    seen = [0]
    ws = base_url.replace("http://", "ws://") + "/v1/stream"
    work = [asyncio.create_task(ws_resuming([ws], frame, seen)) for frame in KILLED_STREAMS]
    while seen[0] < 20:
        await asyncio.sleep(0.01)
    os.kill(coordinator, signal.SIGKILL)
    return list(await asyncio.gather(*work))


def _until_ready(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not any("Press Ctrl-C" in line for line in lines):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    assert any("specfleet is ready" in line for line in lines), "".join(lines)
    return lines


def _serves(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.faults
def test_up_restarts_a_killed_verifier_or_coordinator_and_every_request_completes(tiny_models: dict[str, Path],
                                                                                  tmp_path: Path) -> None:
    """kill -9 the verifier with 20 greedy requests in flight: ``specfleet up`` starts it again,
    the coordinator re-opens the requests on it from what it relayed, the drafters resume them,
    and all 20 complete token-identical to target-only greedy decoding. Then kill -9 the
    coordinator with 20 other streams in flight: it is started again on the same port, each client
    resumes its stream there (no Redis: the streams are recorded in the state dir), and all 20
    complete token-identical, each token generated once."""
    verifier_port = free_port()
    cmd = _up(tmp_path, tiny_models)
    cmd[cmd.index("--verifier-port") + 1] = str(verifier_port)
    # the killed coordinator's streams must be resumed within the verifier's orphan grace (30 s by
    # default): its restart takes 8.5 s here, and CI's host ran this test up to 1.6x slower
    env = {**os.environ, "SPECFLEET_ORPHAN_GRACE_S": "120"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = _until_ready(proc)
        base_url = next(m.group(1) for line in lines if (m := re.search(r"ready at (http://\S+)", line)))
        victim = int(next(m.group(1) for line in lines if (m := re.search(r"started verifier\s+pid (\d+)", line))))
        stack = SimpleNamespace(ws_url=base_url.replace("http://", "ws://") + "/v1/stream")
        sent = [{"kind": "completion", "model": "target", "prompt": f"def g{i}(y", "max_tokens": 256,
                 "temperature": 0, "ignore_eos": True} for i in range(20)]

        async def run() -> list[tuple]:
            work = asyncio.create_task(stream_many(stack, sent))  # type: ignore[arg-type]
            async with httpx.AsyncClient(timeout=5) as http:
                for _ in range(3000):  # kill once all 20 are sent on (admitted is not enough: a request
                    # admitted but not yet sent when the verifier dies gets a 503 to retry) and it generates
                    routed = [await sample_metric_async(http, f"{base_url}/metrics",
                                                        f'specfleet_coordinator_routed_total{{path="{path}"}}')
                              for path in ("drafter", "target_only")]
                    if sum(routed) == 20 and await sample_metric_async(
                            http, f"http://127.0.0.1:{verifier_port}/metrics", "specfleet_verifier_sessions") > 0:
                        break
                    await asyncio.sleep(0.01)
            os.kill(victim, signal.SIGKILL)
            return await work

        results = asyncio.run(run())
        # the coordinator too is started again when it dies, on the same port, and its clients'
        # streams resume there (recorded in the state dir's SQLite file: no Redis here)
        coordinator = int(next(m.group(1) for line in lines
                               if (m := re.search(r"started coordinator\s+pid (\d+)", line))))
        verifier_metrics = f"http://127.0.0.1:{verifier_port}/metrics"
        before = sample_metric(verifier_metrics, "specfleet_verifier_generated_tokens_total")
        streams = asyncio.run(_kill_mid_stream(base_url, coordinator))
        generated = sample_metric(verifier_metrics, "specfleet_verifier_generated_tokens_total") - before
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)  # reaps it and closes its pipes (else a later test sees them leak)
    target = load_model(tiny_models["target"])
    for body, (ids, _, done) in zip(sent, results, strict=True):
        assert ids == greedy_reference(target.model, prompt_ids(target, body), 256, set())
        assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 256
    for frame, got in zip(KILLED_STREAMS, streams, strict=True):
        assert got.token_ids == greedy_reference(target.model, prompt_ids(target, frame), KILLED_TOKENS, set())
    assert all(got.resumes >= 1 for got in streams), [got.resumes for got in streams]
    assert generated == len(KILLED_STREAMS) * KILLED_TOKENS, "the verifier generated some tokens twice"
    assert "restarting in" in err and "verifier (pid" in err and "coordinator (pid" in err, err
    coordinator_log = (tmp_path / "state" / "logs" / "coordinator.log").read_text().splitlines()
    reopened = sum(json.loads(line)["requests"] for line in coordinator_log
                   if "re-opened in-flight requests on a restarted verifier" in line)
    assert reopened == 20, "the kill landed when not all 20 requests were in flight"
    print(f"verifier killed once; {reopened} requests re-opened; {len(results)}/20 completed")
