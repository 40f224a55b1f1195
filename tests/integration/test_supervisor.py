"""The process supervisor behind ``specfleet up``, with real child processes on loopback."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared import supervisor
from shared.supervisor import Child, StartupError, Supervisor, tail

READY_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(int(sys.argv[2]) if self.path == "/ready" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Supervisor]:
    s = Supervisor(tmp_path / "logs")
    yield s
    s.stop(grace_s=2.0)


def test_child_death_before_ready_names_it_and_shows_its_log(sup: Supervisor) -> None:
    sup.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    sup.start("verifier", [sys.executable, "-c", "import sys; print('model dir is bad', file=sys.stderr); sys.exit(3)"])
    with pytest.raises(StartupError) as info:
        sup.wait_ready(f"http://127.0.0.1:{_free_port()}/ready", timeout_s=30)
    message = str(info.value)
    assert "verifier" in message and "exited with code 3" in message
    assert "model dir is bad" in message
    assert "sleeper" not in message


def test_ready_then_clean_stop(sup: Supervisor) -> None:
    port = _free_port()
    child = sup.start("web", [sys.executable, "-c", READY_SERVER, str(port), "200"])
    sup.wait_ready(f"http://127.0.0.1:{port}/ready", timeout_s=30)
    sup.stop(grace_s=5.0)
    assert child.proc.returncode is not None
    assert "serving" in child.log_path.read_text()


def test_timeout_reports_last_answer_and_logs(sup: Supervisor) -> None:
    port = _free_port()
    sup.start("web", [sys.executable, "-c", READY_SERVER, str(port), "503"])
    with pytest.raises(StartupError) as info:
        sup.wait_ready(f"http://127.0.0.1:{port}/ready", timeout_s=1.5, poll_s=0.1)
    message = str(info.value)
    assert "did not answer 200 within 1.5 s" in message
    assert "HTTP 503" in message or "ConnectError" in message
    assert "web (" in message


def test_stop_kills_a_child_that_ignores_sigterm(sup: Supervisor) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    child = sup.start("stubborn", [sys.executable, "-c", code])
    deadline = time.monotonic() + 20
    while "up" not in child.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    sup.stop(grace_s=0.5)
    assert child.proc.returncode == -9
    assert time.monotonic() - started < 10


def test_stop_reaches_grandchildren(sup: Supervisor, tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    sup.start("parent", [sys.executable, "-c", code])
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    sup.stop(grace_s=5.0)
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)  # the grandchild is reparented and reaped by init once it dies
    assert not _alive(grandchild)


def test_watch_returns_the_child_that_exited(sup: Supervisor) -> None:
    sup.start("long", [sys.executable, "-c", "import time; time.sleep(60)"])
    short = sup.start("short", [sys.executable, "-c", "pass"])
    assert sup.watch(poll_s=0.05) is short


def _fails_then_refuses(marker: Path, first_run_s: float = 0.0) -> list[str]:
    """A child that exits 1 on its first run (leaving ``marker``) and 2 ("bad configuration") after."""
    code = (
        "import os, sys, time\n"
        f"marker = {str(marker)!r}\n"
        "if os.path.exists(marker):\n"
        "    print('second run', flush=True); sys.exit(2)\n"
        "open(marker, 'w').close()\n"
        f"time.sleep({first_run_s})\n"
        "print('first run', flush=True); sys.exit(1)\n"
    )
    return [sys.executable, "-c", code]


def _watchdog(sup: Supervisor) -> Child:
    """A non-restartable sibling that exits after a while: should a regression make watch() keep
    restarting a child, watch() returns this one instead of blocking until the test times out."""
    return sup.start("watchdog", [sys.executable, "-c", "import time; time.sleep(15)"])


@pytest.fixture
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "RESTART_FIRST_S", 0.05)
    monkeypatch.setattr(supervisor, "RESTART_MAX_S", 0.3)


@pytest.mark.usefixtures("fast_backoff")
def test_watch_restarts_a_dead_restartable_child_after_its_backoff(sup: Supervisor, tmp_path: Path) -> None:
    child = sup.start("drafter", _fails_then_refuses(tmp_path / "ran-once"), restart=True)
    # Child.backoff_s defaults to the RESTART_FIRST_S of import time (1 s): start this one at the patched value
    child.backoff_s = supervisor.RESTART_FIRST_S
    _watchdog(sup)
    calls: list[tuple[Child, float, bool]] = []
    started = time.monotonic()
    returned = sup.watch(poll_s=0.01, on_restart=lambda c, delay: calls.append((c, delay, c.alive)))
    assert returned is child and child.proc.returncode == 2  # the second run refused: not restarted again
    assert calls == [(child, 0.05, False)]  # told once, with the delay, before the restart
    assert child.restarts == 1
    assert child.backoff_s == pytest.approx(0.1)  # the next delay doubles
    assert time.monotonic() - started >= 0.05
    log = child.log_path.read_text()
    assert "first run" in log and "second run" in log  # the restart appended to the log
    assert log.index("first run") < log.index("--- restarted by the supervisor (restart 1) ---") < log.index(
        "second run")


def test_a_restartable_child_refusing_its_configuration_is_not_restarted(sup: Supervisor) -> None:
    child = sup.start("verifier", [sys.executable, "-c", "import sys; sys.exit(2)"], restart=True)
    _watchdog(sup)
    calls: list[float] = []
    assert sup.watch(poll_s=0.01, on_restart=lambda c, delay: calls.append(delay)) is child
    assert (calls, child.restarts, child.proc.returncode) == ([], 0, 2)
    assert "restarted by the supervisor" not in child.log_path.read_text()


@pytest.mark.usefixtures("fast_backoff")
def test_a_non_restartable_sibling_dying_ends_the_watch(sup: Supervisor) -> None:
    keeper = sup.start("drafter", [sys.executable, "-c", "import time; time.sleep(60)"], restart=True)
    oneshot = sup.start("coordinator", [sys.executable, "-c", "import time; time.sleep(0.2)"])
    calls: list[Child] = []
    assert sup.watch(poll_s=0.01, on_restart=lambda c, delay: calls.append(c)) is oneshot
    assert oneshot.proc.returncode == 0  # even a clean exit of a non-restartable child ends the watch
    assert calls == [] and keeper.restarts == 0 and keeper.alive


def test_backoff_doubles_up_to_the_ceiling_and_starts_over_after_a_healthy_run(
        sup: Supervisor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "RESTART_FIRST_S", 0.05)
    monkeypatch.setattr(supervisor, "RESTART_MAX_S", 0.3)
    monkeypatch.setattr(supervisor, "RESTART_RESET_AFTER_S", 30.0)
    child = sup.start("drafter", [sys.executable, "-c", "print('run', flush=True)"], restart=True)
    delays = []
    for _ in range(5):
        child.proc.wait()
        delays.append(sup.restart_delay(child, time.monotonic()))  # each run far shorter than the reset
        sup.restart(child)
    assert delays == pytest.approx([0.05, 0.1, 0.2, 0.3, 0.3])
    child.proc.wait()
    # a run longer than RESTART_RESET_AFTER_S starts the sequence over
    assert sup.restart_delay(child, child.started_at + 31.0) == 0.05
    sup.restart(child)
    assert sup.restart_delay(child, time.monotonic()) == pytest.approx(0.1)
    child.proc.wait()
    assert child.restarts == 6
    log = child.log_path.read_text()
    assert log.count("run\n") == 7
    assert [f"(restart {i})" in log for i in range(1, 7)] == [True] * 6


@pytest.mark.usefixtures("fast_backoff")
def test_watch_waits_only_the_first_delay_after_a_healthy_run(sup: Supervisor, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "RESTART_RESET_AFTER_S", 0.3)
    child = sup.start("drafter", _fails_then_refuses(tmp_path / "ran-once", first_run_s=0.5), restart=True)
    child.backoff_s = 30.0  # as after many quick failures: a healthy run must not pay for them
    _watchdog(sup)
    delays: list[float] = []
    started = time.monotonic()
    assert sup.watch(poll_s=0.01, on_restart=lambda c, delay: delays.append(delay)) is child
    assert delays == [0.05] and child.restarts == 1
    assert time.monotonic() - started < 10
    assert child.backoff_s == pytest.approx(0.1)  # the next quick failure waits twice as long


def test_tail(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    assert tail(log) == "(no log file)"
    log.write_text("")
    assert tail(log) == "    (empty)"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    assert tail(log, 2) == "    line 28\n    line 29"
