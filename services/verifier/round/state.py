"""One session's current round in the torch engine core: its number and budget, the draft it took,
the fill it settled, the conditional drafts it holds for the next one."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.verifier.core_api import AddDraft
from services.verifier.round.conditional import Upcoming
from services.verifier.round.draft import SettledDraft, filled_outcome, settle
from shared.draft_q import CheckedQ


@dataclass
class Round:
    number: int = 0
    budget: int = 0  # draft tokens the drafter may send for it
    draft: SettledDraft = field(default_factory=SettledDraft)
    #: tokens committed in it while its draft was on its way (``fill``)
    fill: list[int] = field(default_factory=list)
    upcoming: Upcoming[AddDraft] = field(default_factory=Upcoming)
    last_tokens: tuple[int, ...] = ()  # what the previous round committed (a conditional draft's test)
    pause_left: int = 0  # rounds still to run target-only at the drafter's request (Draft.pause_rounds)
    waiting_since: float = field(default_factory=time.perf_counter)  # when it began waiting for its draft

    def take(self, ids: list[int], q: list[CheckedQ] | None, confidence: list[float] | None, *, wait_s: float,
             guess_bonus: bool, drafting_s: float = 0.0, ahead: bool = False) -> None:
        """Its draft arrived ``wait_s`` after the round began waiting: settle it against the fill.
        ``drafting_s`` and ``ahead``: how the drafter made it (``AddDraft``)."""
        self.draft = settle(ids, q, confidence, self.budget, self.fill)
        self.draft.wait_s, self.draft.guess_bonus = wait_s, guess_bonus
        self.draft.drafting_s, self.draft.ahead = drafting_s, ahead

    def outcome(self, verified: int, accepted: int, accept_prob: float) -> tuple[int, int, float]:
        """(drafted, accepted, Σ acceptance probability) of the round as a whole (``filled_outcome``)."""
        return filled_outcome(len(self.fill), self.draft.matched, self.draft.sent, verified, accepted, accept_prob)

    def advance(self, committed: tuple[int, ...]) -> None:
        """The round that committed ``committed`` ended: the next one starts with no draft."""
        self.last_tokens = committed
        self.number += 1
        self.draft = SettledDraft()
        self.fill = []
