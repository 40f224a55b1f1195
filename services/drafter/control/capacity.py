"""How many sessions one drafter should serve: StarSD §4.2, from the drafter's own timings.

A session's round, seen from the drafter, is the draft model's service S (its share of a
drafting batch: the batch's time over its sessions) plus the return time Z (send, the
verifier's queue and forward, the verdict back). With N sessions:

* below N_full = ceil(Z / S) + 1 the draft model has idle gaps (T_idle > 0): adding a session
  only fills them, and per-session speed stays the same (Stage I);
* from N_full on the model is work-conserving (T_idle = 0) and each round waits in its queue:
  per-session speed falls as N grows (Stage II), to E / (N S) tokens/s, where E is the tokens a
  round commits;
* N_max is the largest N whose per-session speed still beats the target alone. The drafter
  cannot see the target's standalone step time; it takes Z, which is at least that (it holds
  a verification forward plus the network), so N_max = max(N_full, floor(E Z / S)).

The drafter claims no new request while it serves N_max sessions (``loop.py``), and drafts
ahead (``lookahead.py``) only below N_full, where the model would otherwise idle. Estimates are
exponentially weighted; until ``WARM_ROUNDS`` rounds are seen they say "no limit".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: weight of a new observation in the moving averages
ALPHA = 0.1
#: rounds observed before the estimates are trusted
WARM_ROUNDS = 20


@dataclass
class Capacity:
    service_s: float = 0.0  # S: draft model time per session per round
    return_s: float = 0.0  # Z: from a Draft sent to its Verdict
    tokens_per_round: float = 0.0  # E: tokens a round commits
    rounds: int = 0

    def observe_batch(self, seconds: float, sessions: int) -> None:
        """A drafting batch (lookaheads excluded) took ``seconds`` for ``sessions`` sessions."""
        if sessions > 0:
            self.service_s = _ewma(self.service_s, seconds / sessions)

    def observe_round(self, return_s: float, committed: int) -> None:
        self.return_s = _ewma(self.return_s, return_s)
        self.tokens_per_round = _ewma(self.tokens_per_round, float(committed))
        self.rounds += 1

    @property
    def warm(self) -> bool:
        return self.rounds >= WARM_ROUNDS and self.service_s > 0

    @property
    def n_full(self) -> int | None:
        """Sessions from which the draft model never idles; None while not warm."""
        return math.ceil(self.return_s / self.service_s) + 1 if self.warm else None

    @property
    def n_max(self) -> int | None:
        """Most sessions worth serving; None while not warm."""
        full = self.n_full
        if full is None:
            return None
        return max(full, math.floor(self.tokens_per_round * self.return_s / self.service_s))


def _ewma(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - ALPHA) * old + ALPHA * new
