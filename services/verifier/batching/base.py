"""Batch selection: which ready sessions go into the next verification pass.

WISP's SLO-aware batching (EDF for sessions past their latest start, then utility density,
checked against memory and deadlines) implements this interface in the next wave, beside the
FCFS baseline here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    """A session that is ready to be verified."""

    session_id: str
    new_tokens: int  # last committed token + drafts
    context_len: int
    ready_since: float  # time.monotonic() when it became ready


@dataclass(frozen=True)
class BatchLimits:
    max_sessions: int
    max_tokens: int


class BatchPolicy(Protocol):
    name: str

    def select(self, ready: Sequence[Candidate], limits: BatchLimits) -> list[str]:
        """Session ids to verify together now (non-empty whenever ``ready`` is)."""
