"""How many sessions a drafter claims (``--admission``): StarSD's N_max (starsd.txt §4.2) beside
its baseline, a fixed ``--max-sessions``.

A drafter at its limit does not poll the queue, so requests go to drafters with capacity left.
StarSD's rule keeps each session faster than the target alone (``capacity.py``); against a
verifier that batches sessions it can cost total throughput, so it is opt-in.
"""

from __future__ import annotations

from typing import Protocol

from services.drafter.control.capacity import Capacity


class Admission(Protocol):
    name: str

    def limit(self, max_sessions: int, capacity: Capacity) -> int:
        """How many sessions the drafter serves now."""
        ...


class MaxSessions:
    """The baseline: always ``--max-sessions``."""

    name = "max-sessions"

    def limit(self, max_sessions: int, capacity: Capacity) -> int:
        return max_sessions


class StarSDAdmission:
    """``--max-sessions``, and at most StarSD's N_max once the estimate is warm."""

    name = "starsd"

    def limit(self, max_sessions: int, capacity: Capacity) -> int:
        return min(max_sessions, capacity.n_max or max_sessions)


ADMISSIONS: dict[str, type[Admission]] = {"max-sessions": MaxSessions, "starsd": StarSDAdmission}


def make_admission(name: str) -> Admission:
    try:
        return ADMISSIONS[name]()
    except KeyError:
        raise ValueError(f"--admission must be one of {', '.join(ADMISSIONS)}, got {name!r}") from None
