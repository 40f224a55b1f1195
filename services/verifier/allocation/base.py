"""Draft-length allocation: how many tokens each session may draft in its next round.

After every verified batch the engine core records each round in the :class:`GoodputTracker`
(``tracker.py``) and asks the allocator for the next budgets, which go back in the Verdicts. A
budget of 0 means "no draft this round": the session decodes target-only for that round
without waiting for its drafter (SmartSpec's switch-off), and the drafter waits for the
Verdict that gives it a budget again.

Policies: Fixed-S and Random-S (GoodSpeed's baselines, ``fixed.py``, ``random_split.py``),
GoodSpeed's gradient scheduling (``goodspeed.py``) and SmartSpec's goodput maximisation
(``smartspec.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from services.verifier.allocation.tracker import GoodputTracker


@dataclass(frozen=True)
class RoundStats:
    """What one session did in the round just verified."""

    session_id: str
    drafter: str | None  # the drafter's node id (None: decodes target-only)
    drafted: int
    accepted: int
    context_len: int  # committed tokens after the round
    accept_prob: float = 0.0  # Σ min(1, p/q) over the drafted tokens (GoodSpeed eq. 3's numerator)
    draft_wait_s: float = 0.0  # verdict out -> this round's draft in (drafting plus both network legs)
    drafting_s: float = 0.0  # the drafter's own time drafting it (Draft.drafting_s; 0: not timed)
    ahead: bool = False  # drafted during the previous round's verification (a lookahead that came true)
    #: its draft in the engine core -> its verdict judged: the verifier's queue and its step's forward,
    #: the other sessions' share of them included (None: not measured)
    verify_s: float | None = None


class Allocator(Protocol):
    name: str

    def initial(self, session_id: str, tracker: GoodputTracker) -> int:
        """Budget for a session's first round (it is already registered in ``tracker``)."""

    def assign(self, rounds: Sequence[RoundStats], tracker: GoodputTracker) -> dict[str, int]:
        """Budgets for the next round of each session in ``rounds`` (already observed by ``tracker``)."""


@runtime_checkable
class SwitchesOff(Protocol):
    """An allocator that can find speculation not worth it for anyone (SmartSpec's k = 0)."""

    def draft_share(self, tracker: GoodputTracker) -> float:
        """The share of requests arriving now that should be given to a drafter at all (in [0, 1]).
        Called from the event loop while the engine core may be changing the estimates: reads only."""


def expected_tokens(alpha: float, length: int) -> float:
    """x̂(S): tokens a round of ``length`` drafts commits on average, the verifier's own included, when
    each draft is accepted with probability ``alpha`` (GoodSpeed's x̂; SmartSpec and the batch
    policies' candidates use it too)."""
    if alpha >= 1.0:
        return float(length + 1)
    return (1.0 - alpha ** (length + 1)) / (1.0 - alpha)


def draft_share(allocator: Allocator, tracker: GoodputTracker) -> float:
    """The allocator's :meth:`SwitchesOff.draft_share`; 1 for one that never switches speculation off."""
    return allocator.draft_share(tracker) if isinstance(allocator, SwitchesOff) else 1.0


def hand_out(targets: dict[str, int], rounds: Sequence[RoundStats], free: int) -> dict[str, int]:
    """Budgets for the sessions in ``rounds``: their share of a joint allocation over every
    speculating session, in order while the free capacity lasts. Rounds come back at different
    times, so each session moves to its share when its own round returns; Σ S_i ≤ C throughout."""
    out = {}
    for r in rounds:
        out[r.session_id] = min(targets.get(r.session_id, 0), free)
        free -= out[r.session_id]
    return out


def free_capacity(capacity: int, rounds: Sequence[RoundStats], tracker: GoodputTracker) -> int:
    """Tokens of the global budget C not promised to sessions outside ``rounds``: those keep the
    budget they were sent until their own round comes back, so Σ S_i ≤ C holds at every moment."""
    mine = {r.session_id for r in rounds}
    held = tracker.budget_total - sum(tracker.sessions[sid].budget for sid in mine if sid in tracker.sessions)
    return max(0, capacity - held)
