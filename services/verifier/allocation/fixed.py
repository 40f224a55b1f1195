"""Fixed-S: every session drafts the same number of tokens every round (the papers' baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from services.verifier.allocation.base import RoundStats


class FixedAllocator:
    name = "fixed"

    def __init__(self, draft_len: int) -> None:
        if draft_len < 0:
            raise ValueError(f"draft_len must be >= 0, got {draft_len}")
        self.draft_len = draft_len

    def initial(self, session_id: str) -> int:
        return self.draft_len

    def assign(self, rounds: Sequence[RoundStats]) -> dict[str, int]:
        return {r.session_id: self.draft_len for r in rounds}

    def forget(self, session_id: str) -> None:
        return None
