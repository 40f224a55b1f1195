"""Draft-length allocation: how many tokens each session may draft in its next round.

The engine calls ``assign`` after every verified batch with per-session statistics, and sends
each session's budget back in its Verdict. GoodSpeed (gradient scheduling under a global
budget C) and SmartSpec (goodput-maximising length, 0 turns speculation off) implement this
same interface in the next wave, beside the Fixed-S baseline here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RoundStats:
    """What one session did in the round just verified."""

    session_id: str
    drafter: str | None
    drafted: int
    accepted: int
    context_len: int


class Allocator(Protocol):
    name: str

    def initial(self, session_id: str) -> int:
        """Budget for a session's first round."""

    def assign(self, rounds: Sequence[RoundStats]) -> dict[str, int]:
        """Budgets for the next round of each session in ``rounds``."""

    def forget(self, session_id: str) -> None:
        """The session finished; drop any state about it."""
