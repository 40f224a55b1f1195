"""Start the real services as separate processes on loopback, the way `specfleet up` does."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from shared.supervisor import Supervisor
from tests.conftest import free_port

TOKEN = "e2e-token"


@dataclass
class StackSpec:
    drafts: list[Path]  # one drafter per entry
    draft_mode: str = "greedy"
    draft_top_k: int = 16
    draft_len: int = 4
    max_sessions: int = 16  # per drafter
    redis_url: str = ""
    extra_verifier: list[str] = field(default_factory=list)
    extra_coordinator: list[str] = field(default_factory=list)


@dataclass
class Stack:
    base_url: str
    ws_url: str
    supervisor: Supervisor


def _svc(name: str, *flags: str, threads: bool = True) -> list[str]:
    torch_flags = ["--torch-threads", "1"] if threads else []
    return [sys.executable, "-m", "shared.cli", name, "--log-level", "warning", *torch_flags, *flags]


@contextmanager
def run_stack(target: Path, spec: StackSpec, log_dir: Path) -> Iterator[Stack]:
    vport, cport = free_port(), free_port()
    sup = Supervisor(log_dir)
    common = ["--auth-token", TOKEN]
    try:
        sup.start("verifier", _svc("verifier", "--port", str(vport), "--model", str(target),
                                   "--draft-len", str(spec.draft_len), *common, *spec.extra_verifier))
        coord = ["--port", str(cport), "--model", str(target), "--verifier-url",
                 f"ws://127.0.0.1:{vport}/v1/frontend", *common,
                 *spec.extra_coordinator]
        if spec.redis_url:
            coord += ["--redis-url", spec.redis_url]
        sup.start("coordinator", _svc("coordinator", *coord, threads=False))
        queue_url = spec.redis_url or f"ws://127.0.0.1:{cport}/internal/queue"
        for i, draft in enumerate(spec.drafts):
            sup.start(f"drafter-{i + 1}", _svc(
                "drafter", "--verifier-url", f"ws://127.0.0.1:{vport}/v1/drafter", "--queue-url", queue_url,
                "--model", str(draft), "--node-id", f"drafter-{i + 1}", "--max-sessions", str(spec.max_sessions),
                "--draft-mode", spec.draft_mode, "--draft-top-k", str(spec.draft_top_k), "--claim-idle-ms", "2000",
                *common))
        sup.wait_ready(f"http://127.0.0.1:{cport}/ready", timeout_s=180)
        yield Stack(f"http://127.0.0.1:{cport}", f"ws://127.0.0.1:{cport}/v1/stream", sup)
    finally:
        sup.stop()
