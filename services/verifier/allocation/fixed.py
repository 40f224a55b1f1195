"""Fixed-S: every session drafts the same number of tokens every round (GoodSpeed's baseline, §IV).

Without a global budget (``capacity`` 0) each session gets ``draft_len``. With one, each gets
C/N, N being the sessions that speculate now, and never more than ``draft_len``.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.verifier.allocation.base import RoundStats
from services.verifier.allocation.tracker import GoodputTracker


def capacity_for(capacity: int, draft_len: int, tracker: GoodputTracker) -> int:
    """The global budget C: as configured, or (0) ``draft_len`` per speculating session."""
    return capacity if capacity > 0 else draft_len * max(1, tracker.speculative())


class FixedAllocator:
    name = "fixed"

    def __init__(self, draft_len: int, capacity: int = 0) -> None:
        if draft_len < 0 or capacity < 0:
            raise ValueError(f"draft_len and capacity must be >= 0, got {draft_len}, {capacity}")
        self.draft_len, self.capacity = draft_len, capacity

    def _share(self, tracker: GoodputTracker) -> int:
        if self.capacity == 0:
            return self.draft_len
        return min(self.draft_len, self.capacity // max(1, tracker.speculative()))

    def initial(self, session_id: str, tracker: GoodputTracker) -> int:
        return self._share(tracker)

    def assign(self, rounds: Sequence[RoundStats], tracker: GoodputTracker) -> dict[str, int]:
        share = self._share(tracker)
        return {r.session_id: share for r in rounds}
