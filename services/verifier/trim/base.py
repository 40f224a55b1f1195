"""Verifier-side draft trimming: how many of each session's drafts enter the next forward pass.

The engine has chosen a batch (``services.verifier.batching``); before the forward it offers the
drafts that carry confidences to a trim policy, which may cut each session's draft to a prefix.
Cutting a prefix is always lossless: the verifier simply judges fewer drafts, and the tokens it
commits are still the target model's.

What is offered and what is not:

* every session whose drafts carry per-token confidences is one ``TrimItem`` (a session with no
  drafts may be offered with ``confidence=()``; it is kept at 0 drafts but its segment still
  counts in the batch time and yields its one committed token);
* everything else in the batch (sessions with id-only drafts, prefill chunks, sessions without
  drafts the caller chose not to offer) is passed as ``fixed`` segment shapes: they are never
  trimmed, but they occupy the same forward, so they count in the predicted step time. Each fixed
  segment is counted as yielding one token (the bonus or next token every verified decode segment
  yields; drafts the policy cannot see are not credited).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.verifier.batching.estimator import SegmentShape, StepTimeModel

__all__ = ["SegmentShape", "StepTimeModel", "TrimItem", "TrimPolicy", "TrimReport", "acceptance_chain",
           "expected_accepted"]



@dataclass(frozen=True)
class TrimItem:
    """One trimmable session of the batch."""

    session_id: str
    cached: int  # KV rows held before the step (L_cached)
    fed: int  # committed tokens fed this step (>= 1) before the drafts
    confidence: Sequence[float]  # per draft: the drafter's estimate that it is accepted
    drafter: str = ""  # who sent the drafts (a policy may calibrate each drafter's confidences)

    def __post_init__(self) -> None:
        if self.cached < 0:
            raise ValueError(f"session {self.session_id!r}: cached must be >= 0, got {self.cached}")
        if self.fed < 1:
            raise ValueError(f"session {self.session_id!r}: fed must be >= 1, got {self.fed}")

    @property
    def drafts(self) -> int:
        return len(self.confidence)

    def shape(self, kept: int) -> SegmentShape:
        """The segment this session puts in the forward when it keeps ``kept`` drafts."""
        return SegmentShape(new=self.fed + kept, cached=self.cached)


@dataclass(frozen=True)
class TrimReport:
    """The last decision, for metrics."""

    offered: int  # drafts offered over all items
    kept: int  # drafts kept over all items
    expected_tokens: float  # expected committed tokens of the batch as kept (bonus tokens included)
    predicted_s: float  # the step-time model's prediction for the batch as kept
    efficiency: float  # expected_tokens / (predicted_s + the gap), inf if that is <= 0
    fits_slo: bool | None  # predicted_s <= the TPOT SLO; None when no SLO is set
    predictions: int  # model.predict calls made for this decision


class TrimPolicy(Protocol):
    name: str
    last: TrimReport | None

    def keep(
        self, items: Sequence[TrimItem], model: StepTimeModel, fixed: Sequence[SegmentShape] = (),
        gap_s: float = 0.0,
    ) -> dict[str, int]:
        """Drafts to keep per offered session (0 <= kept <= len(confidence)); ``fixed`` is the
        untrimmable rest of the batch; ``gap_s`` is the time between steps that no trim shortens
        (see ``rate``)."""
        ...

    def decide(self, items: Sequence[TrimItem], model: StepTimeModel, fixed: Sequence[SegmentShape]) -> dict[str, int]:
        """The engine's call, once per step with items to offer: drafts to keep per session (a
        session left out keeps all). The policy applies what it has learned (``observe_*``)."""
        ...

    def observe_round(self, drafter: str, confidence: Sequence[float] | None, drafted: int, accepted: int) -> None:
        """A verified round of ``drafter``'s: ``accepted`` of the first ``drafted`` drafts, sent with
        these confidences."""
        ...

    def observe_gap(self, gap_s: float) -> None:
        """The time from the last forward's end to this one's start (see ``rate``)."""
        ...

    def status(self) -> dict[str, object]:
        """What the policy has learned, for ``GET /status`` (empty when nothing)."""
        ...


def acceptance_chain(confidence: Sequence[float]) -> list[float]:
    """P(drafts 1..j all accepted) for each j: the running product of the confidences (adaspec.txt
    §4.2 eq. 7, with the confidence taken as the conditional acceptance probability given that
    the drafts before were accepted). Confidences are clamped to [0, 1] (NaN counts as 0), so the
    chain never rises along a draft."""
    chain, p = [], 1.0
    for c in confidence:
        p *= min(c, 1.0) if c > 0 else 0.0
        chain.append(p)
    return chain


def expected_accepted(confidence: Sequence[float]) -> float:
    """Expected accepted drafts, sum_j prod_{i<=j} c_i (adaspec.txt §4.2 eq. 6-7, the bonus token
    not included): the drafter's E(j) in ``services.drafter.control.throughput`` is 1 + this."""
    return sum(acceptance_chain(confidence))


def check_items(items: Sequence[TrimItem]) -> None:
    seen: set[str] = set()
    for item in items:
        if item.session_id in seen:
            raise ValueError(f"session {item.session_id!r} offered twice")
        seen.add(item.session_id)


def rate(tokens: float, seconds: float, gap_s: float = 0.0) -> float:
    """Tokens per second of a step that takes ``seconds`` and recurs every ``seconds + gap_s``;
    an instantaneous step with no gap is infinitely efficient.

    AdaSpec's efficiency (§4, §5.3) is tokens over the step time, the period of a GPU server
    that is never idle. Here the gap is the verifier's measured time from one forward's end to
    the next one's start: its own work per step (judging, publishing, its event loop) and,
    when it is not saturated, its wait for the next drafts. Dropping a draft shortens neither,
    so a step whose forward is a small part of its period gains little from a shorter forward.
    """
    period = seconds + max(0.0, gap_s)
    return tokens / period if period > 0 else math.inf


def fits(predicted_s: float, tpot_slo_s: float | None) -> bool | None:
    return None if tpot_slo_s is None else predicted_s <= tpot_slo_s


def check_slo(tpot_slo_s: float | None) -> float | None:
    if tpot_slo_s is not None and not tpot_slo_s > 0:
        raise ValueError(f"the TPOT SLO must be > 0 seconds, got {tpot_slo_s}")
    return tpot_slo_s
