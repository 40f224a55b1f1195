"""Random-S: a random split of the global budget C over the sessions (GoodSpeed's baseline, §IV).

Each token of C goes to one of the speculating sessions or to nobody, uniformly, so every split
with Σ S_i ≤ C is possible; the round's sessions get their part while the free budget (C minus
what the other sessions still hold) lasts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.verifier.allocation.base import RoundStats, free_capacity, hand_out
from services.verifier.allocation.fixed import capacity_for
from services.verifier.allocation.tracker import GoodputTracker


class RandomAllocator:
    name = "random"

    def __init__(self, draft_len: int, capacity: int = 0, max_len: int = 16, seed: int | None = None) -> None:
        if draft_len < 0 or capacity < 0 or max_len < 0:
            raise ValueError("draft_len, capacity and max_len must be >= 0")
        self.draft_len, self.capacity, self.max_len = draft_len, capacity, max_len
        self.rng = random.Random(seed)

    def initial(self, session_id: str, tracker: GoodputTracker) -> int:
        free = free_capacity(capacity_for(self.capacity, self.draft_len, tracker), [], tracker)
        return min(self.max_len, self.rng.randint(0, free)) if free else 0

    def assign(self, rounds: Sequence[RoundStats], tracker: GoodputTracker) -> dict[str, int]:
        capacity = capacity_for(self.capacity, self.draft_len, tracker)
        ids = sorted({sid for sid, e in tracker.sessions.items() if e.drafter} | {r.session_id for r in rounds})
        split = dict.fromkeys(ids, 0)
        for _ in range(capacity):
            pick = self.rng.randrange(len(ids) + 1)  # len(ids): the token stays unused
            if pick < len(ids) and split[ids[pick]] < self.max_len:
                split[ids[pick]] += 1
        return hand_out(split, rounds, free_capacity(capacity, rounds, tracker))
