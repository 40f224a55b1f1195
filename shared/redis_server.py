"""A private ``redis-server`` on a free loopback port: for the tests and the benchmarks.

Persistence is off unless asked for (``aof``: an append-only file synced at every write, as the
Kubernetes manifests run Redis), and its files live in ``workdir``. ``scripts/ensure-redis.sh`` installs the
binary. Deployments run their own Redis (``deploy/k8s``); this is never used to serve.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MISSING = "redis-server not found: run scripts/ensure-redis.sh"
START_ATTEMPTS = 3
START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _wait_ready(proc: subprocess.Popen[bytes], port: int) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False  # exited: most likely the port was taken between pick and bind
        if answers_ping(port):
            return True
        time.sleep(0.05)
    return False


def stop_redis(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def start_redis(workdir: Path, prefix: list[str] | None = None, aof: bool = False,
                port: int = 0) -> tuple[subprocess.Popen[bytes], int]:
    """Start redis-server (under ``prefix``, e.g. a taskset); RuntimeError if it is missing or never answers.
    ``aof``: persist every write to ``workdir`` before answering it (``appendfsync always``), so a
    restart on the same ``workdir`` (and ``port``, when given) finds every acknowledged write."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(MISSING)
    log_path = workdir / "redis.log"
    persistence = ["--appendonly", "yes", "--appendfsync", "always"] if aof else ["--appendonly", "no"]
    for _ in range(START_ATTEMPTS):
        chosen = port or _free_port()
        cmd = [*(prefix or []), binary, "--port", str(chosen), "--bind", "127.0.0.1", "--save", "", *persistence,
               "--dir", str(workdir), "--daemonize", "no", "--logfile", str(log_path)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _wait_ready(proc, chosen):
            return proc, chosen
        stop_redis(proc)
    raise RuntimeError(f"redis-server did not start after {START_ATTEMPTS} attempts; see {log_path}")


@contextmanager
def private_redis(workdir: Path, prefix: list[str] | None = None) -> Iterator[int]:
    """A redis-server for the block; yields its loopback port."""
    proc, port = start_redis(workdir, prefix)
    try:
        yield port
    finally:
        stop_redis(proc)
