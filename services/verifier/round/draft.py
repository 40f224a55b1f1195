"""A round's draft, after the fill settled its leading tokens (pure).

A filled round's draft rests on the tokens committed before the round, so when it arrives its
leading tokens are compared with the fill: those that match are already committed (exactly what
verifying them would have committed: the argmax, or the race's winner, at each position), the rest
are verified after the fill, and a draft that left the fill verifies nothing (the drafts after its
first mismatch continue a text the target did not write). The simulator settles its drafts with
the same two functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.acceptance import matched as matched_prefix
from shared.draft_q import CheckedQ


@dataclass
class SettledDraft:
    ids: list[int] = field(default_factory=list)  # the drafts still to verify (after the fill)
    q: list[CheckedQ] | None = None  # their draft distributions (None: one-hot, ids only)
    confidence: list[float] | None = None  # the drafter's confidence in each (the trim's input)
    sent: int = 0  # draft tokens the drafter sent for the round (within its budget)
    matched: int = 0  # of those, the leading ones the fill had already committed
    #: the token after a fully accepted draft is drawn by the keyed race (shared.coupling)
    guess_bonus: bool = False
    wait_s: float = 0.0  # how long the round waited for it
    drafting_s: float = 0.0  # the drafter's time drafting it (0: not timed)
    ahead: bool = False  # a lookahead drafted it, during the previous round's verification


def settle(ids: list[int], q: list[CheckedQ] | None, confidence: list[float] | None, budget: int,
           fill: list[int]) -> SettledDraft:
    """The draft that arrived (cut to the round's budget), with what the fill already committed of it
    settled: the rest is to verify (nothing when it left the fill)."""
    draft = ids[: max(0, budget)]
    agreed = matched_prefix(draft, fill)
    m = settled_drafts(len(draft), len(fill), agreed)
    return SettledDraft(draft[m:], q[m : len(draft)] if q is not None else None,
                 confidence[m : len(draft)] if confidence is not None else None, len(draft), agreed)


def settled_drafts(sent: int, filled: int, matched: int) -> int:
    """How many leading drafts of a round the fill settled: the ``matched`` ones when the draft
    agreed with all ``filled`` tokens (the rest are verified after the fill), all ``sent`` when it
    left the fill or ran out inside it (nothing is verified). No fill: none."""
    return matched if matched == filled else sent


def filled_outcome(filled: int, matched: int, sent: int, verified: int, accepted: int,
                   accept_prob: float) -> tuple[int, int, float]:
    """(drafted, accepted, Σ acceptance probability) of a round as a whole, after ``verified``
    drafts were judged past a fill of ``filled`` tokens and ``accepted`` of them kept: the fill's
    ``matched`` drafts count as accepted ones (probability 1), a mismatch as one rejected draft."""
    if matched < filled:  # the draft left the fill (or ran out inside it)
        return min(sent, matched + 1), matched, float(matched)
    return matched + verified, matched + accepted, matched + accept_prob
