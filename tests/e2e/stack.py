"""Start the real services as separate processes on loopback, as `specfleet up` does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from shared.fleet import Fleet, FleetSpec, running_fleet
from tests.conftest import free_port

TOKEN = "e2e-token"
Stack = Fleet


@dataclass
class StackSpec:
    drafts: list[Path]  # one drafter per entry
    draft_mode: str = "sampled"  # greedy: ids-only drafts for every request
    q_mass: float = 0.98  # sampled drafts: the q nucleus's mass...
    q_max_entries: int = 4096  # ...and most entries
    draft_len: int = 4
    max_sessions: int = 16  # per drafter
    redis_url: str = ""
    extra_coordinator: list[str] = field(default_factory=list)
    drafter_log_level: str = "warning"
    extra_drafter: list[str] = field(default_factory=list)
    extra_verifier: list[str] = field(default_factory=list)
    per_drafter: list[list[str]] = field(default_factory=list)  # drafter i also gets entry i (they win)
    verifier_port: int = 0  # 0: a free one
    ready_timeout_s: float = 180.0  # for the coordinator's /ready: every model loaded, every link up


@contextmanager
def run_stack(target: Path, spec: StackSpec, log_dir: Path) -> Iterator[Fleet]:
    quiet = ["--log-level", "warning"]
    fleet = FleetSpec(
        target=target, drafts=spec.drafts, coordinator_port=free_port(),
        verifier_port=spec.verifier_port or free_port(),
        redis_url=spec.redis_url,
        # a known draft length (Fixed-S) for the mechanisms these tests check; extra_verifier may choose
        # another policy (the default, smartspec-per-drafter, adapts it: tests/real and the unit tests)
        verifier_flags=[*quiet, "--draft-len", str(spec.draft_len), "--allocation", "fixed", *spec.extra_verifier],
        # requests wait for a drafter (no target-only start after --queue-wait-s): these tests check
        # speculation, and a drafter slow to claim its first request on a loaded host once left every
        # request of a run to finish target-only before any was drafted; extra_coordinator may set it
        coordinator_flags=[*quiet, "--queue-wait-s", "0", *spec.extra_coordinator],
        drafter_flags=["--log-level", spec.drafter_log_level, "--max-sessions", str(spec.max_sessions),
                       "--draft-mode", spec.draft_mode, "--q-mass", str(spec.q_mass),
                       "--q-max-entries", str(spec.q_max_entries), "--claim-idle-ms", "2000", *spec.extra_drafter],
        per_drafter_flags=spec.per_drafter,
    )
    with running_fleet(fleet, log_dir, TOKEN, spec.ready_timeout_s) as running:
        yield running
