"""Draft while expected throughput still rises (``--controller adaspec``): AdaSpec's adaptive
drafter (adaspec.txt §4-5.1).

The efficiency of a round that drafts j tokens is E(j) / T(j):

* E(j) = 1 + sum_{i<=j} prod_{m<=i} a_m, the expected committed tokens (eq. 6-7): a_m is the
  conditional probability that draft m is accepted given the ones before it were, estimated from
  the draft model's confidence in it (its probability), through a calibration learned from the
  verifier's verdicts;
* T(j) = j t_draft + z0 + z1 j, the expected round time: the drafter's measured time per draft
  token, and a line fitted to the measured return time (send, verify, verdict) against j.

E/T is quasi-concave in j (Theorem 4.3), so drafting stops at the first j where one more token is
predicted to lower it. Predict, execute, correct (§5.1): before each draft step the next token's
confidence is predicted as the historical mean at that position; after the step, its actual
confidence replaces the prediction. The clock and the calibration are shared by all sessions
of one drafter; each session's controller keeps only its round.

The paper controls the length of a batch's drafts (§5.1, "at the batch level"). Here each
session decides its own, and the drafter drafts the sessions ready together in one forward per
position (``batcher.py``), returning every draft when the longest is done. So a session's next
token costs it the step only when it drafts alone: in a batch of n, while the others draft on,
its share t_draft / n (``worth_one_more``; ``StepFeatures.rows``). Charging every session the
whole step stopped drafts that cost nothing to lengthen: at 24 requests/s in ``bench load``
(2026-11-27 14:55) AdaSpec drafted about 4 tokens a round against fixed k = 5's 5, and its rounds
took no less time.

When no draft is worth it, the round drafts nothing and the drafter asks the verifier to run
the next rounds without waiting for it (``Draft.pause_rounds``, ``rounds.PAUSE_ROUNDS``); every
``PROBE_EVERY``-th such decision drafts one token instead, so that the calibration keeps
learning and drafting resumes when it pays again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.drafter.control.base import StepDecision, StepFeatures
from shared.calibration import ALPHA, AcceptanceCalibration, ewma

#: after this many rounds in a row that the controller chose not to draft, it drafts one token:
#: a round that drafts nothing teaches the calibration nothing, so without a probe a controller
#: whose estimates once fell too low would never draft again
PROBE_EVERY = 4
MAX_POSITIONS = 64


@dataclass
class RoundClock:
    """T(j): time per draft token, and the return time as a line in the draft length."""

    draft_token_s: float = 0.0  # 0 until a round waited for its drafting (read as: unmeasured)
    # exponentially weighted sums for the least-squares line return_s = z0 + z1 * drafted
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    _line: tuple[float, float] | None = field(default=None, repr=False, compare=False)  # line(), until observe

    def observe(self, drafted: int, draft_s: float, return_s: float) -> None:
        """``draft_s`` is the round's drafting compute: 0 when a lookahead had the draft ready
        (drafted while the previous round was verified). Those rounds count at 0 per token, so
        ``draft_token_s`` is the drafting time per token that rounds wait for: a model that
        charged every token its full drafting time would stop a pipelining drafter too early.
        The clock is shared by a drafter's sessions, and only a few of them pipeline
        (``--pipeline-sessions``): when the load rises past that, it takes about 1/ALPHA rounds
        to catch up, drafting a little too much meanwhile."""
        if drafted > 0:
            per = draft_s / drafted
            self.draft_token_s = per if self.draft_token_s == 0 else ewma(self.draft_token_s, per)
        x, decay = float(drafted), 1 - ALPHA
        self._w, self._x, self._y = decay * self._w + 1, decay * self._x + x, decay * self._y + return_s
        self._xx, self._xy = decay * self._xx + x * x, decay * self._xy + x * return_s
        self._line = None

    def line(self) -> tuple[float, float]:
        """(z0, z1) of the return time; a flat line until the draft lengths vary. Kept until the
        next observation: every drafted token of every session asks for it."""
        if self._line is None:
            self._line = self._fit()
        return self._line

    def _fit(self) -> tuple[float, float]:
        if self._w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        z1 = max(0.0, (self._xy / self._w - mean_x * mean_y) / var) if var > 1e-9 else 0.0
        return max(0.0, mean_y - z1 * mean_x), z1

    def round_time(self, j: int) -> float:
        z0, z1 = self.line()
        return j * self.draft_token_s + z0 + z1 * j


@dataclass
class Calibration(AcceptanceCalibration):
    """The shared calibration (``shared.calibration``), and the mean confidence by position that
    predicts the next draft's before it is drafted."""

    mean_conf: list[float] = field(default_factory=list)  # historical mean confidence by position

    def predicted_confidence(self, position: int) -> float:
        if position < len(self.mean_conf):
            return self.mean_conf[position]
        return self.mean_conf[-1] if self.mean_conf else 0.5

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """Learn acceptance from the judged drafts; every draft's confidence feeds its position's mean."""
        super().observe(confidences, accepted)
        for i, c in enumerate(confidences[:MAX_POSITIONS]):
            if i < len(self.mean_conf):
                self.mean_conf[i] = ewma(self.mean_conf[i], c)
            else:
                self.mean_conf.append(c)


@dataclass
class ThroughputState:
    """What all sessions of one drafter share."""

    clock: RoundClock = field(default_factory=RoundClock)
    calibration: Calibration = field(default_factory=Calibration)
    declined: int = 0  # rounds in a row (over all sessions) that drafting was judged not worth it


def worth_one_more(alphas: list[float], shared: ThroughputState, rows: int = 1) -> bool:
    """Predict the next token's acceptance from history; execute only if E/T would rise.

    One more token lengthens the round by the verification's slope z1 and by a draft step, all
    of it when the session drafts alone (``rows`` 1: T(j + 1)). A batched drafter drafts for
    ``rows`` sessions in one forward, and each session's round returns with its batch, so the
    session's own stop saves the step only when every other session stops too: while they draft
    on, its next token costs about its share of the step."""
    cal, clock = shared.calibration, shared.clock
    guess = cal.accept(cal.predicted_confidence(len(alphas)))
    now = clock.round_time(len(alphas))
    later = now + clock.draft_token_s / max(1, rows) + clock.line()[1]
    return _ratio(expected_tokens([*alphas, guess]), later) > _ratio(expected_tokens(alphas), now)


def expected_tokens(alphas: list[float]) -> float:
    """E(j): the round's expected committed tokens, 1 + the sum of the acceptance chain's products."""
    expected, chain = 1.0, 1.0
    for a in alphas:
        chain *= a
        expected += chain
    return expected


def efficiency(alphas: list[float], clock: RoundClock) -> float:
    """E(j) / T(j) for the drafts so far (j = len(alphas))."""
    return _ratio(expected_tokens(alphas), clock.round_time(len(alphas)))


def _ratio(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("inf")


class ThroughputController:
    name = "adaspec"
    wants_features = True
    wants_spread = False

    def __init__(self, shared: ThroughputState) -> None:
        self.shared = shared
        self._alphas: list[float] = []
        self._confs: list[float] = []
        self._budget = 0

    def begin_round(self, budget: int) -> int:
        self._alphas, self._confs, self._budget = [], [], budget
        if budget <= 0 or self.shared.clock.draft_token_s == 0:  # nothing measured yet: draft the budget
            return max(0, budget)
        if worth_one_more(self._alphas, self.shared):  # before the batch forms: as if alone
            self.shared.declined = 0
            return budget
        self.shared.declined += 1
        if self.shared.declined >= PROBE_EVERY:  # probe: one token keeps the estimates learning
            self.shared.declined = 0
            return 1
        return 0

    def on_step(self, step: StepFeatures) -> StepDecision:
        self._confs.append(step.token_prob)  # correct: the executed token's own confidence
        self._alphas.append(self.shared.calibration.accept(step.token_prob))
        if len(self._alphas) >= self._budget or self.shared.clock.draft_token_s == 0:
            return StepDecision.CONTINUE
        return StepDecision.CONTINUE if worth_one_more(self._alphas, self.shared, step.rows) else StepDecision.STOP

    def keeps(self, steps: Sequence[StepFeatures], budget: int) -> int:
        """What begin_round then on_step over ``steps`` would keep, worked out in locals (the round
        state is the round in flight's); a declined round's probe aside: a conditional Draft is
        never a probe."""
        n = min(len(steps), max(0, budget))
        if n == 0 or self.shared.clock.draft_token_s == 0:
            return n
        if not worth_one_more([], self.shared):
            return 0
        alphas: list[float] = []
        for step in steps[:n - 1]:  # the budget's last token is kept without asking
            alphas.append(self.shared.calibration.accept(step.token_prob))
            if not worth_one_more(alphas, self.shared, step.rows):
                return len(alphas)
        return n

    def end_round(self, drafted: int, accepted: int, draft_s: float = 0.0, verify_s: float = 0.0) -> None:
        self.shared.calibration.observe(self._confs[:drafted], accepted)
        self.shared.clock.observe(drafted, draft_s, verify_s)
