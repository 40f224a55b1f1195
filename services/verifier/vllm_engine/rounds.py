"""Rounds over a continuous decoder: one session's bookkeeping in the vLLM backend (pure).

vLLM decodes every running request at every step and never waits for a draft, while the
drafter protocol is a sequence of rounds (a Draft for round r, then the Verdict of round r).
:class:`LiveSession` maps one onto the other. Round r rests on the ``published`` tokens the
drafter has heard of; vLLM's tokens since then are ``pending``. The round ends (and its
Verdict carries every pending token) as soon as the draft can do no more:

* the tokens since the base left the draft (a rejection, or vLLM decoded past a late draft),
* or they cover it (all drafts accepted, plus the target's own token),
* or no draft came while more tokens were decoded than the budget allowed (a late draft could
  no longer propose anything),
* or the session runs target-only, or the request finished.

So a Verdict may commit tokens the drafter never drafted, and ``accepted`` counts the draft's
tokens that match what was committed, wherever they came from.

A drafter's lookahead may come before the Verdict it assumes, as the next round's *conditional*
draft (``Draft.after``). The session holds it, and the round that follows a round committing
exactly its ``after`` begins with it, at once. Where vLLM outruns the edge (a small target on a
CPU decodes a round's budget in about the time a fresh draft takes to make the round trip), it
is a draft that need not make that trip.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.verifier.round.conditional import Offered, Upcoming
from shared.acceptance import matched

__all__ = ["LiveSession", "Offered", "Resolved"]


@dataclass(frozen=True)
class Resolved:
    """One finished round: the tokens it commits and how the draft fared."""

    round: int
    base: int  # generated tokens before this round's tokens
    drafted: int
    accepted: int
    tokens: list[int]


class LiveSession:
    def __init__(self, request_id: str, prompt_len: int, speculative: bool, budget: int, *, drafter: str = "",
                 draft_at: float = 0.0, published: list[int] | None = None) -> None:
        self.request_id, self.prompt_len = request_id, prompt_len
        self.speculative = speculative
        self.budget = budget  # draft tokens the drafter may send for the current round
        self.drafter = drafter
        self.round = 0
        self.published: list[int] = published if published is not None else []  # generated tokens already sent out
        self.pending: list[int] = []  # generated since, not sent yet
        self.draft: list[int] | None = None  # the current round's draft (None: not arrived)
        self.draft_at = draft_at  # when the current round began waiting for its draft
        self.draft_wait_s = 0.0
        self.drafting_s, self.ahead = 0.0, False  # how the drafter made the current draft (AddDraft)
        self.last: tuple[int, ...] = ()  # the tokens the previous round committed
        self.upcoming: Upcoming[list[int]] = Upcoming()  # conditional drafts for the next round

    @property
    def base_len(self) -> int:
        """The context length (prompt included) the current round's draft rests on."""
        return self.prompt_len + len(self.published)

    def take_draft(self, round_: int, ids: list[int], now: float, drafting_s: float = 0.0, ahead: bool = False) -> bool:
        """Record the round's draft; False when it is stale (its round already ended) or a duplicate."""
        if round_ != self.round or self.draft is not None or not self.speculative:
            return False
        self.draft = ids[: max(0, self.budget)]
        self.draft_wait_s = max(0.0, now - self.draft_at)
        self.drafting_s, self.ahead = drafting_s, ahead
        return True

    def offer(self, round_: int, after: tuple[int, ...], ids: list[int], now: float) -> Offered:
        """A conditional draft (``round.conditional``): held when it is for the next round; taken
        when its round already began after committing exactly ``after`` and has no draft yet;
        otherwise dropped."""
        placed = self.upcoming.place(round_, self.round, after, self.last, ids, holds=self.speculative,
                                     takes=self.speculative and self.draft is None)
        if placed == "taken":
            self.take_draft(round_, ids, now, ahead=True)
        return placed

    def promote(self) -> tuple[bool, int]:
        """Begin the round that just began with the held draft whose ``after`` the last round
        committed, clipped to the new budget. Returns whether one was taken and how many were dropped."""
        came_true, held = self.upcoming.came_true(self.last)
        if came_true is None or not self.speculative or self.budget <= 0:
            return False, held
        self.draft, self.draft_wait_s = came_true[: self.budget], 0.0
        self.drafting_s, self.ahead = 0.0, True
        return True, held - 1

    def detach(self) -> None:
        """Continue target-only: no draft, no drafter, nothing held."""
        self.speculative, self.draft, self.drafter = False, None, ""
        self.upcoming.clear()

    def attach(self, drafter: str, budget: int, now: float) -> None:
        """A drafter resumes the session: its next round waits for that drafter's draft."""
        self.speculative, self.drafter, self.budget = True, drafter, budget
        self.draft, self.draft_at = None, now
        self.upcoming.clear()

    def live_draft(self) -> list[int] | None:
        """The draft, when some of it may still be proposed after the pending tokens."""
        if self.draft is None or len(self.pending) >= len(self.draft):
            return None
        return self.draft if matched(self.draft, self.pending) == len(self.pending) else None

    def due(self) -> bool:
        """Whether the current round is over (see the module docstring)."""
        if not self.pending:
            return False
        if not self.speculative or self.budget <= 0:
            return True
        if self.draft is None:
            return len(self.pending) > self.budget
        return self.live_draft() is None

    def resolve(self, now: float) -> Resolved:
        """End the round: every pending token is published; the next round begins (with a held
        conditional draft once its budget is set: :meth:`promote`)."""
        draft = self.draft or []
        done = Resolved(self.round, len(self.published), len(draft), matched(draft, self.pending), list(self.pending))
        self.published.extend(self.pending)
        self.last = tuple(self.pending)
        self.pending = []
        self.draft = None
        self.draft_at = now
        self.round += 1
        return done
