"""Per-session draft budgets: the allocator's choice, capped, held in the goodput tracker.

The one owner of this bookkeeping, which every verifier shares: the torch core, the vLLM core and
the simulator's verifier (``bench/sim``).

    open(session, drafter)   the session speculates: register it, return its first budget
    attach(session, drafter) register it (or its new drafter) without a budget yet
    served(sessions, ...)    a step's live sessions and tokens committed (the measured guard's input)
    next(rounds)             a step's verified rounds: fold them into α̂ and X (GoodSpeed eqs. 3-4),
                             then the allocator's next budgets, capped at ``max_draft_tokens``
    hold(session, budget)    a budget decided outside the allocator (a paused drafter: 0)
    detach / forget          the session lost its drafter / ended
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from services.verifier.allocation import Allocator, GoodputTracker, RoundStats, draft_share


class DraftBudgets:
    def __init__(self, allocator: Allocator, tracker: GoodputTracker, max_draft_tokens: int) -> None:
        self.allocator, self.tracker, self.cap = allocator, tracker, max_draft_tokens
        self.initial_s = 0.0  # how long the allocator's last ``initial`` took
        self.assign_s = 0.0  # how long its last ``assign`` took

    def attach(self, session_id: str, drafter: str | None) -> None:
        self.tracker.open(session_id, drafter or None)

    def open(self, session_id: str, drafter: str | None) -> int:
        self.attach(session_id, drafter)
        return self.initial(session_id)

    def initial(self, session_id: str) -> int:
        """The session's budget for a round that starts its speculation (afresh after an attach)."""
        started = time.perf_counter()
        budget = self.allocator.initial(session_id, self.tracker)
        self.initial_s = time.perf_counter() - started
        return self.hold(session_id, budget)

    def next(self, rounds: Sequence[RoundStats]) -> dict[str, int]:
        """Learn from the rounds, then the next budget of each session the allocator assigns one."""
        for r in rounds:
            self.tracker.observe(r)
        started = time.perf_counter()
        assigned = self.allocator.assign(rounds, self.tracker) if rounds else {}
        self.assign_s = time.perf_counter() - started
        return {sid: self.hold(sid, budget) for sid, budget in assigned.items()}

    def served(self, sessions: int, committed: int, context: float) -> None:
        """One step's serving (live sessions, tokens committed, their mean context), for a policy
        that checks speculation against the clock (``allocation.pays``)."""
        watch = getattr(self.allocator, "served", None)
        if watch is not None:
            watch(sessions, committed, context)

    def hold(self, session_id: str, budget: int) -> int:
        budget = min(budget, self.cap)
        self.tracker.set_budget(session_id, budget)
        return budget

    def detach(self, session_id: str) -> None:
        self.tracker.detach(session_id)

    def forget(self, session_id: str) -> None:
        self.tracker.forget(session_id)

    @property
    def total(self) -> int:
        """Σ budgets held by the live sessions."""
        return self.tracker.budget_total

    def draft_share(self) -> float:
        return draft_share(self.allocator, self.tracker)
