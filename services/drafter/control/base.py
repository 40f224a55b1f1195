"""When to stop drafting within the verifier's budget: the controller interface.

The verifier grants each round a draft *budget* k (how many tokens it is willing to verify).
A controller may spend less: after every drafted token it sees that step's features (read from
the draft model's own distribution) and decides whether to keep the token and go on, keep it
and stop, or drop it and stop. Stopping at a predicted rejection saves the draft compute and
the verification slots a doomed token would waste (WISP §3; AdaSpec §4 stops when one more
token would lower expected efficiency). After the Verdict, ``end_round`` reports how many of
the drafted tokens the target accepted, so an adaptive controller can learn per session.

One controller instance serves one session; controllers are called from the compute worker
thread and must not block or touch the event loop.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class StepDecision(enum.Enum):
    CONTINUE = "continue"  # keep this token; draft the next one if the budget allows
    STOP = "stop"  # keep this token; draft no more this round
    DISCARD = "discard"  # drop this token (predicted rejection) and draft no more


class Spread(NamedTuple):
    """How spread out the draft model's distribution is (computed only when a controller wants it)."""

    entropy: float = math.nan  # nats
    logit_std: float = math.nan  # spread of the raw logits over the vocabulary


@dataclass(frozen=True)
class StepFeatures:
    """What a controller sees about one freshly drafted token.

    The probabilities come from the draft model's raw distribution (softmax of its logits at
    temperature 1), whatever the request's sampling settings: they describe how sure the draft
    model is, which is what predicts acceptance.
    """

    position: int  # 0-based index of this token within the round's draft
    budget: int  # the most tokens this round may draft
    token_id: int
    token_prob: float  # draft probability of the drafted token
    top1_prob: float
    top2_prob: float
    spread: Spread = field(default_factory=Spread)  # NaN unless the controller ``wants_spread``
    rows: int = 1  # sessions the draft model's forward drafted a token for in this step, this one included

    @property
    def margin(self) -> float:
        """Top-1 minus top-2 probability: a small margin means the draft model is torn."""
        return self.top1_prob - self.top2_prob


class DraftController(Protocol):
    """Per-session drafting policy. Implementations: fixed, threshold, adaspec, wisp.

    ``wants_features``: whether ``on_step`` reads the step features. When False the proposer
    neither computes them nor calls ``on_step``.

    ``wants_spread``: whether it reads ``entropy`` and ``logit_std`` too. Those cost two more
    passes over the vocabulary per drafted token (about 40 µs a token over 4,096 tokens on this
    machine's CPU, against about 6 µs for the probabilities alone), so they are computed only
    for a controller that reads them, and are NaN otherwise.
    """

    name: str
    wants_features: bool
    wants_spread: bool

    def begin_round(self, budget: int) -> int:
        """The most tokens to draft this round (0..budget)."""

    def on_step(self, step: StepFeatures) -> StepDecision:
        """Decide about the token just drafted."""

    def keeps(self, steps: Sequence[StepFeatures], budget: int) -> int:
        """How many of a ready draft's first tokens a round beginning now would keep (``steps``: their
        features, positions from 0), as ``begin_round`` and ``on_step`` would decide, without changing
        any state: it screens a lookahead sent before the verdict of the round in flight, which
        still owns the controller's round state (``lookahead.py``, conditional drafts)."""

    def end_round(self, drafted: int, accepted: int, draft_s: float = 0.0, verify_s: float = 0.0) -> None:
        """Feedback: of ``drafted`` tokens sent, the target accepted the first ``accepted``; drafting
        took ``draft_s`` (0 when the draft was ready from a lookahead) and the verdict came
        ``verify_s`` after the Draft was sent."""


def keep_until_stop(decide: Callable[[StepFeatures], StepDecision], steps: Sequence[StepFeatures], budget: int) -> int:
    """How many of ``steps`` (at most ``budget``) a round keeps when ``decide`` judges each token in
    turn: up to and including the first it stops at, or up to the first it discards."""
    for i, step in enumerate(steps[:max(0, budget)]):
        decision = decide(step)
        if decision is StepDecision.DISCARD:
            return i
        if decision is StepDecision.STOP:
            return i + 1
    return min(len(steps), max(0, budget))
