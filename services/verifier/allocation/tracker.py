"""Per-session acceptance and goodput estimates, kept whatever the allocation policy.

GoodSpeed (goodspeed.txt §III-B) defines, for each client i after its round t:

* eq. 3: α̂_i(t) = (1 − η)·α̂_i(t−1) + η·(1/S_i(t))·Σ_j min(1, p_j(s_j)/q_ij(s_j)), the smoothed
  acceptance rate from the verified tokens' acceptance probabilities (for a greedy request the
  acceptance probability of a draft is 1 when it is the target's argmax and 0 otherwise). The
  sum is over the tokens drafted and S_i(t) is the length *allotted*: a drafter that leaves
  budget unused (prompt lookup with no match, a controller that stops early) counts the unused
  tokens as not accepted, so capacity moves to drafters that use it;
* eq. 4: X_i(t) = (1 − β)·X_i(t−1) + β·x_i(t), the smoothed goodput, where x_i(t) is the round's
  accepted tokens plus the one the verifier adds.

The utility the paper maximises is U = Σ_i log X_i; :meth:`GoodputTracker.sum_log_x` gives it,
so every policy (baselines included) is scored the same way. A "client" here is a session; a
new session starts from the latest estimates of its drafter's previous session, so a drafter
that serves one request after another (the paper's setting) carries its estimates across them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.verifier.allocation.base import RoundStats


@dataclass
class Estimate:
    drafter: str | None
    alpha: float  # α̂_i
    goodput: float  # X_i, tokens per round
    budget: int = 0  # S_i last sent
    rounds: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class DrafterSummary:
    sessions: int
    alpha: float  # mean α̂ over its sessions
    goodput: float  # Σ X over its sessions
    budget: int  # Σ S over its sessions


class GoodputTracker:
    def __init__(self, eta: float = 0.1, beta: float = 0.1, alpha0: float = 0.5, goodput0: float = 1.0) -> None:
        for name, value in (("eta", eta), ("beta", beta)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not 0.0 <= alpha0 < 1.0 or goodput0 <= 0:
            raise ValueError(f"alpha0 must be in [0, 1) and goodput0 > 0, got {alpha0}, {goodput0}")
        self.eta, self.beta = eta, beta
        self.alpha0, self.goodput0 = alpha0, goodput0
        self.sessions: dict[str, Estimate] = {}
        self.rounds = 0  # rounds observed in all
        #: Σ S_i over the live sessions and how many have a drafter, kept as estimates change, so
        #: that an allocation over thousands of sessions does not re-add them every round
        self.budget_total = 0
        self._speculative = 0
        #: tokens committed through each drafter's rounds since the start (accepted drafts + the
        #: verifier's own token): its empirical goodput x̄_i, GoodSpeed Fig. 4's utility input
        self.committed_by_drafter: dict[str, int] = {}
        self._last_of_drafter: dict[str, Estimate] = {}

    def open(self, session_id: str, drafter: str | None) -> Estimate:
        """Register a session (idempotent); it inherits its drafter's latest estimates."""
        est = self.sessions.get(session_id)
        if est is None:
            prior = self._last_of_drafter.get(drafter) if drafter else None
            alpha, goodput = (prior.alpha, prior.goodput) if prior else (self.alpha0, self.goodput0)
            est = self.sessions[session_id] = Estimate(drafter, alpha, goodput)
            self._speculative += bool(drafter)
        elif drafter and est.drafter != drafter:
            self._speculative += not est.drafter
            est.drafter = drafter  # resumed by another drafter
        return est

    def observe(self, r: RoundStats) -> Estimate:
        """Fold one verified round into the session's α̂ (eq. 3) and X (eq. 4)."""
        est = self.open(r.session_id, r.drafter)
        allotted = max(r.drafted, est.budget)  # S_i(t): the round's budget (never below what came)
        if allotted > 0:
            rate = min(1.0, max(0.0, r.accept_prob / allotted))
            est.alpha = (1 - self.eta) * est.alpha + self.eta * rate
        est.goodput = (1 - self.beta) * est.goodput + self.beta * (r.accepted + 1)
        est.rounds += 1
        est.accepted += r.accepted
        self.rounds += 1
        if est.drafter:
            self._last_of_drafter[est.drafter] = est
            self.committed_by_drafter[est.drafter] = self.committed_by_drafter.get(est.drafter, 0) + r.accepted + 1
        return est

    def set_budget(self, session_id: str, budget: int) -> None:
        est = self.sessions.get(session_id)
        if est is not None:
            self.budget_total += budget - est.budget
            est.budget = budget

    def detach(self, session_id: str) -> None:
        """The session lost its drafter: it decodes target-only and holds no draft budget."""
        est = self.sessions.get(session_id)
        if est is not None:
            self.budget_total -= est.budget
            self._speculative -= bool(est.drafter)
            est.budget, est.drafter = 0, None

    def forget(self, session_id: str) -> None:
        est = self.sessions.pop(session_id, None)
        if est is None:
            return
        self.budget_total -= est.budget
        self._speculative -= bool(est.drafter)
        if est.drafter:
            self._last_of_drafter[est.drafter] = Estimate(est.drafter, est.alpha, est.goodput)

    def sum_log_x(self) -> float:
        """GoodSpeed's utility U = Σ_i log X_i over the live sessions."""
        return sum(math.log(max(est.goodput, 1e-9)) for est in self.sessions.values())

    def speculative(self) -> int:
        """Live sessions that have a drafter."""
        return self._speculative

    def by_drafter(self) -> dict[str, DrafterSummary]:
        groups: dict[str, list[Estimate]] = {}
        for est in self.sessions.values():
            if est.drafter:
                groups.setdefault(est.drafter, []).append(est)
        return {name: DrafterSummary(len(g), sum(e.alpha for e in g) / len(g), sum(e.goodput for e in g),
                                     sum(e.budget for e in g))
                for name, g in groups.items()}
