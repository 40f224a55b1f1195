"""SmartSpec's goodput-maximising proposal length (smartspec.txt §4–5, eq. 3, 4, 8, Alg. 2).

Goodput is the expected tokens a batch generates over the time the batch takes:

    goodput(k) = Σ_i l(α_i, k) / (T_target(batch with k drafts each) + T_draft(k))
    l(α, k)    = (1 − α^(k+1)) / (1 − α)                     (eq. 8, the bonus token included)

The policy tries every proposal length k in 0…V for the sessions just verified (the batch that
comes back next) and gives them the best one; k = 0 is plain decoding, so speculation switches
itself off when the verifier is saturated and extra tokens cost more than they return.

* α_i is a moving average of session i's per-round acceptance rate over its last ``window``
  rounds (SmartSpec's "top-1 candidate" estimate, request-level granularity).
* T_target comes from the shared verification-time estimator (``batching/estimator.py``), whose
  coefficients are profiled offline and refined online by least squares.
* T_draft is SmartSpec's eq. 4 term. Here drafts are made at the edge, so it is the time the
  verifier waits for a draft of k tokens (drafting plus both network legs), fitted online as
  e0 + e1·k by least squares over recent rounds; with k = 0 no draft is awaited and it is 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from services.verifier.allocation.base import RoundStats
from services.verifier.allocation.goodspeed import expected_tokens
from services.verifier.allocation.tracker import GoodputTracker
from services.verifier.batching.estimator import SegmentShape, StepTimeModel

EDGE_WINDOW = 256  # recent rounds the draft-wait line is fitted on


class DraftWaitModel:
    """Least-squares line through (k, seconds the verifier waited for a k-token draft)."""

    def __init__(self, window: int = EDGE_WINDOW) -> None:
        self.points: deque[tuple[int, float]] = deque(maxlen=window)
        self.e0, self.e1 = 0.0, 0.0

    def observe(self, k: int, seconds: float) -> None:
        if k <= 0 or seconds <= 0:
            return
        self.points.append((k, seconds))
        n = len(self.points)
        mean_k = sum(p[0] for p in self.points) / n
        mean_t = sum(p[1] for p in self.points) / n
        var = sum((p[0] - mean_k) ** 2 for p in self.points)
        slope = sum((p[0] - mean_k) * (p[1] - mean_t) for p in self.points) / var if var > 0 else 0.0
        self.e1 = max(0.0, slope)
        self.e0 = max(0.0, mean_t - self.e1 * mean_k)

    def predict(self, k: int) -> float:
        return 0.0 if k <= 0 else self.e0 + self.e1 * k


def best_length(alphas: Sequence[float], contexts: Sequence[int], max_len: int, model: StepTimeModel,
                wait: DraftWaitModel) -> tuple[int, float]:
    """(k, goodput) maximising eq. 3's goodput for one batch over k in 0…max_len."""
    best_k, best = 0, -1.0
    for k in range(max_len + 1):
        tokens = sum(expected_tokens(a, k) for a in alphas)
        seconds = model.predict([SegmentShape(new=1 + k, cached=c) for c in contexts]) + wait.predict(k)
        goodput = tokens / max(seconds, 1e-9)
        if goodput > best:
            best_k, best = k, goodput
    return best_k, best


class SmartSpecAllocator:
    name = "smartspec"

    def __init__(self, model: StepTimeModel, draft_len: int, max_len: int = 8, window: int = 16,
                 alpha0: float = 0.5) -> None:
        if draft_len < 0 or max_len < 0 or window < 1:
            raise ValueError("draft_len and max_len must be >= 0 and window >= 1")
        self.model, self.max_len, self.window, self.alpha0 = model, max_len, window, alpha0
        self.last_k = min(draft_len, max_len)
        self.last_goodput = 0.0
        self.wait = DraftWaitModel()
        self._rates: dict[str, deque[float]] = {}

    def initial(self, session_id: str, tracker: GoodputTracker) -> int:
        return self.last_k

    def alpha(self, session_id: str) -> float:
        rates = self._rates.get(session_id)
        return sum(rates) / len(rates) if rates else self.alpha0

    def assign(self, rounds: Sequence[RoundStats], tracker: GoodputTracker) -> dict[str, int]:
        for r in rounds:
            self.wait.observe(r.drafted, r.draft_wait_s)
            if r.drafted > 0:
                self._rates.setdefault(r.session_id, deque(maxlen=self.window)).append(r.accepted / r.drafted)
        live = set(tracker.sessions)
        for sid in [s for s in self._rates if s not in live]:
            del self._rates[sid]
        if not rounds:
            return {}
        self.last_k, self.last_goodput = best_length([self.alpha(r.session_id) for r in rounds],
                                                     [r.context_len for r in rounds], self.max_len, self.model,
                                                     self.wait)
        return {r.session_id: self.last_k for r in rounds}
