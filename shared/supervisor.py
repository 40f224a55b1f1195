"""Start, watch and stop the child processes of ``specfleet up``.

Plain blocking code on purpose: the supervisor only waits on processes and polls one HTTP
endpoint, so an event loop would add nothing. Each child runs in its own session (process
group), so a Ctrl-C in the terminal reaches the supervisor alone and it can stop the children
in order; on Linux each child is also told to die with its parent, so killing the supervisor
outright (SIGKILL) cannot leave a verifier holding its port.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

_PR_SET_PDEATHSIG = 1


class StartupError(RuntimeError):
    """The fleet did not become ready; the message names the culprit and shows its log."""


#: Restart backoff of a restartable child: first delay, ceiling, and how long a run must last for
#: the delay to start over. Exit code 2 means "refused its configuration": never restarted.
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
RESTART_RESET_AFTER_S = 60.0
NO_RESTART_CODES = frozenset({2})


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes]
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = False  # restart it with backoff when it dies, instead of stopping the fleet
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    backoff_s: float = 0.0  # the next restart delay after a short run; 0: RESTART_FIRST_S

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ("(empty)" when there is nothing to show)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log file)"
    kept = text.rstrip("\n").splitlines()[-lines:]
    return "\n".join("    " + line for line in kept) if kept else "    (empty)"


def death_report(child: Child) -> str:
    """One paragraph saying which child died, how, and what its log said last."""
    code = child.proc.returncode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    last = tail(child.log_path)
    return f"{child.name} (pid {child.proc.pid}) {how}. Last lines of {child.log_path}:\n{last}"


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask Linux to SIGTERM it when the parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the supervisor's own shutdown path still stops the children


class Supervisor:
    """Owns a set of named child processes whose output goes to ``<log_dir>/<name>.log``."""

    def __init__(self, log_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = dict(os.environ if env is None else env)
        self.children: list[Child] = []

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              restart: bool = False) -> Child:
        """Start a child. ``restart``: when it dies, ``watch`` restarts it with backoff."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        full_env = {**self.env, **(env or {})}
        child = Child(name, list(argv), log_path, self._spawn(list(argv), log_path, full_env, "wb"), full_env,
                      restart)
        self.children.append(child)
        return child

    @staticmethod
    def _spawn(argv: list[str], log_path: Path, env: dict[str, str], mode: str) -> subprocess.Popen[bytes]:
        with log_path.open(mode) as log:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )

    @staticmethod
    def restart_delay(child: Child, died_at: float) -> float:
        """How long to wait before restarting ``child``, which died at ``died_at``: the first delay
        after a healthy run (one of RESTART_RESET_AFTER_S or more), else the doubled delay of the
        last restart (up to RESTART_MAX_S). Also sets the delay that follows this one."""
        healthy = died_at - child.started_at >= RESTART_RESET_AFTER_S
        delay = RESTART_FIRST_S if healthy or child.backoff_s <= 0 else child.backoff_s
        child.backoff_s = min(2 * delay, RESTART_MAX_S)
        return delay

    def restart(self, child: Child) -> None:
        """Start a dead child again, appending to its log."""
        with child.log_path.open("ab") as log:
            log.write(f"\n--- restarted by the supervisor (restart {child.restarts + 1}) ---\n".encode())
        child.proc = self._spawn(child.argv, child.log_path, child.env, "ab")
        child.restarts += 1
        child.started_at = time.monotonic()

    def dead(self) -> list[Child]:
        return [c for c in self.children if not c.alive]

    def wait_ready(self, url: str, timeout_s: float, poll_s: float = 0.25, verify: str | bool = True) -> None:
        """Block until GET ``url`` answers 200; raise StartupError if a child dies or time runs out.
        ``verify``: for https://, the CA file to trust (or True: the system's)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        context = ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify
        with httpx.Client(timeout=2.0, verify=context) as client:
            while True:
                dead = self.dead()
                if dead:
                    reports = "\n".join(death_report(c) for c in dead)
                    raise StartupError(f"a service died before the fleet was ready:\n{reports}")
                try:
                    resp = client.get(url)
                    if resp.status_code == 200:
                        return
                    last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    raise StartupError(self._timeout_report(url, timeout_s, last))
                time.sleep(poll_s)

    def _timeout_report(self, url: str, timeout_s: float, last: str) -> str:
        logs = "\n".join(f"{c.name} ({c.log_path}):\n{tail(c.log_path, 8)}" for c in self.children)
        return (
            f"{url} did not answer 200 within {timeout_s:g} s (last: {last}). Every service is still "
            f"running; raise --ready-timeout if the models are large. Last lines of each log:\n{logs}"
        )

    def watch(self, poll_s: float = 0.5, on_restart: Callable[[Child, float], None] | None = None) -> Child:
        """Block until a child dies that must not be restarted, and return it.

        A restartable child that dies is started again after its backoff delay (``on_restart`` is
        told first, with the delay), unless it exited with a code in NO_RESTART_CODES.
        """
        due: dict[str, float] = {}
        while True:
            now = time.monotonic()
            for child in self.dead():
                if not child.restart or child.proc.returncode in NO_RESTART_CODES:
                    return child
                if child.name not in due:
                    delay = self.restart_delay(child, now)
                    due[child.name] = now + delay
                    if on_restart is not None:
                        on_restart(child, delay)
                elif now >= due[child.name]:
                    del due[child.name]
                    self.restart(child)
            time.sleep(poll_s)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child's process group (last started first), wait, then SIGKILL stragglers."""
        for child in reversed(self.children):
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(child, signal.SIGKILL)
                child.proc.wait()
        for child in self.children:
            _signal_group(child, signal.SIGKILL)  # grandchildren a child left behind, if any


def _signal_group(child: Child, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)
