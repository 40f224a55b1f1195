"""A real redis-server for the test session (imported by tests/conftest.py).

``redis_url`` starts ``redis-server`` on a free loopback port with persistence off, in a
temporary directory, and stops it when the session ends. Tests share it, so each test uses
its own stream name. Without the binary the tests skip, or fail when ``CI=true`` (CI must
not silently lose the Redis coverage); ``scripts/ensure-redis.sh`` installs it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["redis_url"]

_MISSING = "redis-server not found: run scripts/ensure-redis.sh"
_START_ATTEMPTS = 3
_START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _wait_ready(proc: subprocess.Popen[bytes], port: int) -> bool:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False  # exited: most likely the port was taken between pick and bind
        if _answers_ping(port):
            return True
        time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _start(binary: str, workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    log_path = workdir / "redis.log"
    for _ in range(_START_ATTEMPTS):
        port = _free_port()
        cmd = [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--daemonize",
            "no",
            "--logfile",
            str(log_path),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _wait_ready(proc, port):
            return proc, port
        _stop(proc)
    pytest.fail(f"redis-server did not start after {_START_ATTEMPTS} attempts; see {log_path}")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``redis://127.0.0.1:<port>/0`` of a redis-server private to this test session."""
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(_MISSING)
        pytest.skip(_MISSING)
    proc, port = _start(binary, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(proc)
