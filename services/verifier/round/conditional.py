"""Conditional drafts: a drafter's lookahead sent before the Verdict it assumes (``Draft.after``).

One rule for every verifier (the torch core's rounds and the vLLM backend's): a draft for the
round after the current one is held, with the tokens the current round must commit for it to
apply; one for the current round is taken at once when the round still waits for its draft and
the previous round committed exactly its ``after``; any other is dropped without a word (the
drafter drafts the round afresh when the Verdict tells it). When a round ends, the held draft
whose ``after`` it committed, if one came, begins the next round.
"""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from shared.protocol import MAX_CONDITIONAL_DRAFTS

#: what became of a conditional draft on arrival
Offered = Literal["held", "taken", "dropped"]
T = TypeVar("T")


class Upcoming(Generic[T]):
    """The conditional drafts held for the next round, each with the tokens it assumes."""

    def __init__(self) -> None:
        self.held: list[tuple[tuple[int, ...], T]] = []

    def __len__(self) -> int:
        return len(self.held)

    def place(self, draft_round: int, current: int, after: tuple[int, ...], last: tuple[int, ...],
              draft: T, *, holds: bool, takes: bool) -> Offered:
        """Where a conditional draft for ``draft_round`` goes while round ``current`` runs, after a
        round that committed ``last``: held (``holds``: the session speculates), taken now
        (``takes``: the round still waits for its draft; the caller takes it), or dropped."""
        if draft_round == current + 1 and holds and len(self.held) < MAX_CONDITIONAL_DRAFTS:
            self.held.append((after, draft))
            return "held"
        if draft_round == current and takes and after == last:
            return "taken"
        return "dropped"

    def came_true(self, committed: tuple[int, ...]) -> tuple[T | None, int]:
        """The round ended committing ``committed``: the held draft that assumed it (None if none)
        and how many were held in all. Nothing stays held."""
        held, self.held = self.held, []
        return next((draft for after, draft in held if after == committed), None), len(held)

    def clear(self) -> int:
        """Drop them all (a new drafter, or a session target-only); how many were held."""
        dropped, self.held = len(self.held), []
        return dropped
