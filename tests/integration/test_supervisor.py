"""The process supervisor behind ``specfleet up``, with real child processes on loopback."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.supervisor import StartupError, Supervisor, tail

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


def test_tail(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    assert tail(log) == "(no log file)"
    log.write_text("")
    assert tail(log) == "    (empty)"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    assert tail(log, 2) == "    line 28\n    line 29"
