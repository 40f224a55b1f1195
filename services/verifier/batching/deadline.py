"""Deadline batching (``--batching wisp``): WISP's SLO-aware verification batching (wisp.txt §3.1
eq. 4–6, §4.2 eq. 12–16, §4.3 eq. 17, Alg. 1).

**Token-speed SLO (§3.1).** Each request belongs to an SLO class with a target token speed
s_c (tokens/s; ``Candidate.clock.slo_tokens_per_s``, else the batcher's default; ``None`` = best
effort). We measure speed over the whole stream: a request that arrived at A and has committed
G output tokens by time t meets its SLO iff G ≥ s_c·(t − A) (:func:`slo_met`). This is eq. 4
summed over all of the request's speculate–verify iterations (ΣN_v / ΣT_total), so slack won
in earlier rounds carries over and a request that fell behind can catch up.

**Deadline (eq. 6 and eq. 12, streaming form).** Eq. 6 gives the server-side budget of one
round, τ_c(i) = N̂_v/s_c − T_draft − T_network, counted from the round's arrival a_i at the
server, and eq. 12 sets d_i = a_i + τ_c(i). Counting instead from the request's arrival A_i,
where everything spent before this round reached the server (earlier rounds, this round's
drafting and network time) is already elapsed, we take

    τ_c(i) = (G_i + N̂_v,i)/s_c − (a_i − A_i),   so   d_i = A_i + (G_i + N̂_v,i)/s_c,

with G_i = ``generated``, N̂_v,i = ``expected_tokens`` (eq. 5: the drafts expected to be
accepted plus the target's own token) and A_i = ``arrived_at``. d_i is exactly the latest
completion time at which the request still meets its SLO once this round commits its expected
tokens: C_i ≤ d_i ⇔ ``slo_met(A_i, G_i + N̂_v,i, s_c, C_i)``. Best-effort requests have d_i = +∞.
The verifier counts A_i from when the request's coordinator took it (``OpenSession.waited_s``
moves it back by the queue and the edge). What its clock cannot see is the rest of eq. 6's
T_network on the user's side: the client's hop to the coordinator and each commit's way back
to the user's screen. ``network_s`` (T_net, with any safety margin) takes it off every
deadline, d_i = A_i + (G_i + N̂_v,i)/s_c − T_net, so a request scheduled just in time here is
in time for its user.
The clock starts at A_i, so queueing and prefill before the first token count against the SLO;
a caller that wants them excluded passes the first token's time as ``arrived_at``. A candidate
with an SLO needs a real ``arrived_at`` (the default 0.0 makes it look long overdue).

**Ordering (§4.2–4.3).** v̂_i is the predicted time to verify the candidate alone (the time
model on its own L_new, L_cached), U_i = N̂_v,i / v̂_i (eq. 16) and LST_i = d_i − v̂_i − δ (eq. 17),
with δ a guard time for estimation error. Candidates with now ≥ LST_i are critical and go first,
by earliest deadline (EDF); the rest follow by decreasing U_i. Ties go to the earlier ready one.

**Growth (Alg. 1).** Candidates are added in that order while the batch stays within
``max_sessions``, the step's ``max_tokens``, the KV budget (eq. 14; m̂_i = ``kv_tokens``) and
the deadline check of ``FeasibleAdd`` (eq. 15: now + T̂(B ∪ {i}) ≤ min deadline, without δ, as
in Alg. 1). The first failure ends the batch, critical phase or not; the best-effort fill runs
only when every critical candidate was admitted. Our interpretations:

* A candidate that cannot meet its deadline even when verified alone now (now + v̂_i > d_i) is
  already violated: it is exempt from the deadline check, both as the one being added and as a
  member, so late critical requests are still served, in EDF order (Alg. 1 as written would stop
  at such a request forever). Its cost still counts towards T̂, protecting the others.
* Best-effort candidates (d_i = +∞) are never violated themselves but may not push others late.
* The first candidate in order is always taken, whatever the limits, so the batch is never
  empty when ``ready`` is not (the same rule as FCFS for an oversized first session).
* Stopping at the first violation (rather than skipping) can leave smaller candidates behind, and
  a low-utility best-effort request can wait long under sustained load: that is Alg. 1's greedy.

**Riders.** The scheduler may decode, in the same step, sessions still waiting for their drafts
(``Scheduler._add_riders``). Each is one more row of the step, so :meth:`DeadlineBatcher.riders_fit`
puts them through the same ``FeasibleAdd`` against the batch's tightest deadline: riders that would
make the step end after it are left out (a rider is a session's extra token, never worth a
member's deadline).

**Cost.** Ranking n candidates is arithmetic on the model's affine coefficients (eq. 19, read off
by four probes per decision), then a heap selection of the first ``max_sessions + 1``: O(n log k).
Each tentative batch is checked with one ``predict_sums`` call on running sums (ΣL_new,
Σ L_total·L_new, ΣL_cached) against the chosen members' tightest deadline: O(1) per addition.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from services.verifier.batching.base import BatchLimits, Candidate

_Ranked = tuple[float, float, int, float, float]  # (sort key, ready_since, index in ready, d_i, v̂_i)

DEFAULT_DELTA_S = 0.02  # guard time δ: about 1.5× the estimator MAE the paper reports (13.24 ms, §4.4)


class SumsTimeModel(Protocol):
    """A verification-time model on pre-summed batch features, affine in them (wisp.txt §4.4 eq. 19).

    WISP ranks candidates with the model's coefficients, read off by probing it, and checks each
    tentative batch with the model itself.
    """

    def predict_sums(self, new: float, total_new: float, cached: float) -> float:
        """Seconds for a batch with ΣL_new = ``new``, Σ(L_total·L_new) = ``total_new``, ΣL_cached = ``cached``."""
        ...


def round_deadline(cand: Candidate, default_slo_tokens_per_s: float | None, network_s: float = 0.0) -> float:
    """d_i = A_i + (G_i + N̂_v,i)/s_c − T_net (module docstring; wisp.txt eq. 6, 12); +∞ for best effort."""
    slo = cand.clock.slo_tokens_per_s if cand.clock.slo_tokens_per_s is not None else default_slo_tokens_per_s
    if slo is None or slo <= 0:
        return math.inf
    return cand.clock.arrived_at + (cand.clock.generated + cand.expected_tokens) / slo - network_s


_PROBE = (256.0, 256.0 * 4096.0, 4096.0)  # a typical batch (ΣL_new, Σ L_total·L_new, ΣL_cached) to probe at


def _coefficients(model: SumsTimeModel) -> tuple[float, float, float, float]:
    """(a, b, c, d) of the affine model T = a·ΣL_new + b·Σ(L_total·L_new) + c·ΣL_cached + d, read off by
    four probes at and beside a typical batch (clear of any floor a model puts on tiny batches), so
    ranking n candidates costs arithmetic rather than n model calls."""
    n, tn, k = _PROBE
    t = model.predict_sums(n, tn, k)
    a = (model.predict_sums(2 * n, tn, k) - t) / n
    b = (model.predict_sums(n, 2 * tn, k) - t) / tn
    c = (model.predict_sums(n, tn, 2 * k) - t) / k
    return a, b, c, t - a * n - b * tn - c * k


@dataclass(slots=True)
class _Batch:
    """The batch being grown, with the running sums that make each feasibility check O(1)."""

    now: float
    ids: list[str] = field(default_factory=list)
    tokens: int = 0
    kv: int = 0
    new: float = 0.0  # ΣL_new
    total_new: float = 0.0  # Σ(L_total·L_new)
    cached: float = 0.0  # ΣL_cached
    tight: float = math.inf  # tightest deadline among members that can still meet theirs

    def add(self, cand: Candidate, binding: float) -> None:
        self.ids.append(cand.session_id)
        self.tokens += cand.new_tokens
        self.kv += cand.kv_tokens
        self.grow(cand.new_tokens, cand.cached)
        self.tight = min(self.tight, binding)

    def grow(self, n: int, cached: int) -> None:
        """The time model's sums with one more segment: ``n`` new tokens over ``cached`` KV rows."""
        self.new += n
        self.total_new += (cached + n) * n
        self.cached += cached

    def ends_with(self, model: SumsTimeModel, n: int, cached: int) -> float:
        """When the step would end with that segment added (eq. 15's now + T̂(B ∪ {i}))."""
        return self.now + model.predict_sums(self.new + n, self.total_new + (cached + n) * n, self.cached + cached)


class DeadlineBatcher:
    """WISP's SLO-aware greedy batch scheduler (wisp.txt §4.3, Alg. 1); see the module docstring.

    ``model`` predicts verification time from summed features (the step-time estimator),
    ``default_slo_tokens_per_s`` is the target for candidates without their own (``None`` = best
    effort), ``delta_s`` is the guard time δ of eq. 17, ``clock`` gives dispatch time t_k on the
    candidates' clock, ``kv_budget_tokens`` bounds Σ ``kv_tokens`` (M of eq. 14; ``None`` = no
    bound) and ``network_s`` is T_net, the user's side of eq. 6's T_network, taken off every
    deadline. After each ``select``, ``last_critical`` holds how many candidates were critical and
    ``last_stop`` why growth ended ("sessions", "tokens", "kv", "deadline"; ``None``: all admitted).
    """

    name = "wisp"

    def __init__(self, model: SumsTimeModel, default_slo_tokens_per_s: float | None = None,
                 delta_s: float = DEFAULT_DELTA_S, clock: Callable[[], float] = time.perf_counter,
                 kv_budget_tokens: int | None = None, network_s: float = 0.0) -> None:
        if default_slo_tokens_per_s is not None and not default_slo_tokens_per_s > 0:
            raise ValueError(f"default_slo_tokens_per_s must be > 0 or None, got {default_slo_tokens_per_s}")
        if not delta_s >= 0:
            raise ValueError(f"delta_s must be >= 0, got {delta_s}")
        if not network_s >= 0:
            raise ValueError(f"network_s must be >= 0, got {network_s}")
        if kv_budget_tokens is not None and kv_budget_tokens < 0:
            raise ValueError(f"kv_budget_tokens must be >= 0 or None, got {kv_budget_tokens}")
        self.model = model
        self.default_slo_tokens_per_s = default_slo_tokens_per_s
        self.delta_s = delta_s
        self.clock = clock
        self.kv_budget_tokens = kv_budget_tokens
        self.network_s = network_s
        self.last_critical = 0
        self.last_stop: str | None = None
        self._last: _Batch | None = None  # the last batch selected, for its riders

    def select(self, ready: Sequence[Candidate], limits: BatchLimits) -> list[str]:
        """Alg. 1 at dispatch epoch t_k = ``clock()``: session ids in admission order."""
        self.last_critical, self.last_stop, self._last = 0, None, None
        if not ready:
            return []
        now = self.clock()
        batch = _Batch(now)
        for n_tried, (_, _, i, d, v) in enumerate(self._rank(ready, now, max(limits.max_sessions, 1) + 1)):
            binding = d if now + v <= d else math.inf  # a deadline it cannot meet anyway binds nothing
            if n_tried:  # the first one is always taken: never empty
                self.last_stop = self._violation(batch, ready[i], binding, limits)
                if self.last_stop is not None:
                    break
            batch.add(ready[i], binding)
        self._last = batch
        return batch.ids

    def riders_fit(self, cached: Sequence[int]) -> int:
        """How many of the riders (one new token each over ``cached`` KV rows, in order) the last batch
        takes with its predicted end still within its tightest deadline (module docstring)."""
        if self._last is None or self._last.tight == math.inf:
            return len(cached)
        batch = replace(self._last, ids=[])  # the sums grow; the batch selected stays as it was
        for taken, k in enumerate(cached):
            if batch.ends_with(self.model, 1, k) > batch.tight:
                return taken
            batch.grow(1, k)
        return len(cached)

    def _rank(self, ready: Sequence[Candidate], now: float, k: int) -> list[_Ranked]:
        """Alg. 1 lines 10–17: critical candidates by EDF, then the rest by decreasing utility; only
        the first ``k`` (no batch can use more), as (key, ready_since, index, d_i, v̂_i)."""
        a, b, c, const = _coefficients(self.model)
        default, inf, start_by, net = self.default_slo_tokens_per_s, math.inf, now + self.delta_s, self.network_s
        crit: list[_Ranked] = []
        rest: list[_Ranked] = []
        for i, cand in enumerate(ready):
            n, cached, gain = cand.new_tokens, cand.cached, cand.expected_tokens
            v = (a + b * (cached + n)) * n + c * cached + const  # v̂_i: verified alone
            clock = cand.clock
            slo = clock.slo_tokens_per_s
            if slo is None:
                slo = default
            # d_i, as round_deadline (inlined: this loop runs for every pending candidate)
            d = clock.arrived_at + (clock.generated + gain) / slo - net if slo is not None and slo > 0 else inf
            if d - v <= start_by:  # now ≥ LST_i = d_i − v̂_i − δ (eq. 17); never when d = +∞
                crit.append((d, cand.ready_since, i, d, v))
            else:
                rest.append((-gain / v if v > 0 else -inf, cand.ready_since, i, d, v))
        self.last_critical = len(crit)
        top = heapq.nsmallest(k, crit)
        return top + heapq.nsmallest(k - len(top), rest)

    def _violation(self, batch: _Batch, cand: Candidate, binding: float, limits: BatchLimits) -> str | None:
        """``FeasibleAdd`` (Alg. 1 lines 3–8) plus the step's session and token limits, in O(1)."""
        if len(batch.ids) >= limits.max_sessions:
            return "sessions"
        if batch.tokens + cand.new_tokens > limits.max_tokens:
            return "tokens"
        if self.kv_budget_tokens is not None and batch.kv + cand.kv_tokens > self.kv_budget_tokens:
            return "kv"
        if batch.ends_with(self.model, cand.new_tokens, cand.cached) > min(batch.tight, binding):
            return "deadline"
        return None
