"""SmartSpec's goodput-maximising proposal length (smartspec.txt §4–5, eq. 3, 4, 8, Alg. 2).

Goodput is the expected tokens the sessions generate over the time a round of theirs takes:

    goodput(k) = N·l(α, k) / max(Σ_forwards [T_target(its m sessions, k) + h(m)],
                                 T_draft(k) + T_target(one session, k) + h(1))
    l(α, k)    = (1 − α^(k+1)) / (1 − α)                     (eq. 8, the bonus token included)
    h(n)       = e0 + e1·n, the verifier's measured busy time between forwards (off: the paper's 0)
    forwards   = ⌈N / B_k⌉ of B_k = max(1, min(max_batch_sessions, ⌊max_batch_tokens / (1 + k)⌋)) sessions

(the paper's T_target + T_draft for one session, and its batch of every running request; the
bullets below say why the max).

After every verified step the policy tries every proposal length k in 0…V and gives the best
one to the sessions just verified; k = 0 is plain decoding, so speculation switches itself off
when extra tokens cost more than they return. While it is off, PROBE_STEPS of every
PROBE_EVERY steps draft anyway, so that the acceptance estimate stays measured; the draft
waits it decided on expire instead (``draft_wait.WAIT_HORIZON_S``), and speculation is tried again.

* α is the per-token acceptance rate of eq. 8 (the chance that a draft is accepted once every
  draft before it was), estimated over the recent drafted steps of all sessions, as many as
  hold ALPHA_TESTS tested drafts: SmartSpec's "global token acceptance rate" (§4.4, Alg. 2
  lines 13-14), the granularity the paper ships. A round tests its drafts in order until the
  first rejection, so it shows ``accepted`` successes and one failure when it stopped short;
  α = Σ successes / Σ tests. (Accepted over drafted would be biased low: with α = 0.8 and k = 4
  it is 0.59.) A window of 16 steps instead held 5-10 drafts a step at low load, and its α
  swung from 0.43 to 1.0 within seconds at 6 requests/s, each low swing switching speculation
  off. When speculation is off no step adds to it, so it keeps the rate speculation last had.
* T_target comes from the shared verification-time estimator (``batching/estimator.py``), whose
  coefficients are profiled offline and refined online by least squares.
* T_draft is SmartSpec's eq. 4 term. Here drafts are made at the edge, so it is the time the
  verifier waits for a draft of k tokens (drafting plus both network legs plus the edge's other
  work), fitted online as a level per load band plus a slope in k (``draft_wait.py``; 0 for a
  draft that was in before its round began: a conditional draft that came true); a round whose
  session drafted nothing in its previous round is left out: a first round (its draft also paid
  the drafter's prefill) and the first drafted round after a pause (the drafter caught up on the
  tokens decoded without it). While every measured round has the same length the slope is 0:
  the per-token drafting cost shows once lengths differ. So when the drafter times its drafts
  (``Draft.drafting_s``), the wait is priced from its parts instead: network, drafting per token,
  and the lookaheads that draft the next round during this one's verification and so cost no
  wait when they are done in time (``draft_wait.Timed``). Until BAND_MIN of a drafter's fresh
  drafts are timed, the length is held (the slope is unknown), and the first length chosen on
  the timings is chosen afresh; a timed choice then changes for TIMED_MARGIN more goodput. A
  round also takes time that neither its wait nor its priced verification holds (the event
  loops, the Verdict's way out): measured as each session's time between its rounds less both,
  it is added to the round, and to the lookahead's head start (``Timed.rest``). With k = 0 no
  draft is awaited and it is 0. Its verification is the core's own measure (``RoundStats.verify_s``:
  draft in to verdict), not the priced one: at 64 requests a round also waited behind the other
  sessions' forwards and shared a forward of 32 of them, 0.34 s that ``rest`` then added to the round
  on top of :func:`verify_all`, which prices that work already; k = 4's goodput read 355 tokens/s
  against plain decoding's 502 and SmartSpec drafted in 10 % of rounds, where Fixed-S k = 4 served
  1.12x target-only (2026-12-07, EPYC). Unlike the paper's colocated drafter, an edge drafter does not
  take the verifier's time: while one session's draft is made, the verifier verifies the
  others' (see :func:`goodputs`).
* The paper's batch holds every running request. Here a step holds only the sessions whose
  drafts are in, so the length is chosen for all live sessions (target-only ones share the
  steps too), and it changes only for a predicted gain of SWITCH_MARGIN or more. Past the
  verifier's batch limits (``--max-batch-sessions``, ``--max-batch-tokens``) they take several
  forwards, each with its fixed cost and busy time, which plain decoding's rounds of one token
  amortise worst (:func:`verify_all`).
* In the paper a request switched to k = 0 costs nothing more than plain decoding. Here it
  still came through the queue and a drafter on the edge, which adds to its first token, and
  its drafter still follows every round. So while k = 0 is best for a request arriving now (priced
  at the most live sessions of a step in the last WAIT_HORIZON_S: the load it will live through), the
  verifier's FleetStatus asks for drafts for none of the new requests
  (:meth:`SmartSpecAllocator.draft_share`), and a coordinator in ``--speculation auto`` opens
  them target-only. Draft waits expire after ``draft_wait.WAIT_HORIZON_S``, so speculation is tried again at
  that pace, and a burst's long waits do not keep it off.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from services.verifier.allocation.base import RoundStats, expected_tokens
from services.verifier.allocation.draft_wait import NO_WAIT, DraftWaitModel
from services.verifier.allocation.tracker import GoodputTracker
from services.verifier.batching.base import BatchLimits
from services.verifier.batching.estimator import RecentLine, SegmentShape, StepTimeModel
from shared.calibration import judged

#: while speculation is off, every this many-th batch drafts anyway (``draft_len`` tokens), so
#: that the acceptance estimate it was switched off on keeps being measured; a probe lasts
#: PROBE_STEPS batches. Its draft waits are not counted: a drafter that drafts only now and then
#: waits longer than one that speculates (it catches its cache up, and nothing is drafted ahead)
PROBE_EVERY = 32
PROBE_STEPS = 4
#: the chosen length changes only for this much more predicted goodput: a drafter pays for every
#: change (a lookahead drafted for the old length is lost), and the noisy draft waits would
#: otherwise flip it from step to step (at 16 requests, 5 runs: 1.08x target-only with 5 %,
#: 1.14x with 20 %)
SWITCH_MARGIN = 0.2
#: the margin while the drafter's own timings price the waits (``draft_wait.Timed``): its parts are
#: averages over up to BAND_WINDOW rounds of TIMED_HORIZON_S, steadier than the waits of the last
#: WAIT_HORIZON_S, and 0.2 held a length chosen on the first few timings (T = 1, one request: k = 8
#: kept where the parts priced k = 3 1.18x better)
TIMED_MARGIN = 0.05
ALPHA_TESTS = 1024  # the tested drafts α is estimated over (whole steps, the newest kept)


def goodputs(alpha: float, sessions: int, context: int, max_len: int, model: StepTimeModel,
             wait: DraftWaitModel, overhead: RecentLine | None = None,
             limits: BatchLimits | None = None) -> list[float]:
    """Eq. 3's goodput of ``sessions`` alike live sessions (``context`` tokens each) at each k in
    0…max_len: their expected tokens over the time in which each completes a round.

    A round is the verifier's work for all of them (:func:`verify_all`), or one session's loop,
    its draft wait plus its own verification, whichever is longer: while one session's draft is
    made at the edge the verifier verifies the others', so the wait only costs the verifier when
    it has nothing else to do (one session: the paper's T_target + T_draft).

    ``overhead`` (the core's measured busy time between forwards, a line in the step's sessions)
    adds the verifier's work outside the forward to each step: it is what makes a round of several
    tokens cheaper per token than plain decoding's round of one when the verifier is busy. Assumed
    the same whatever k is (judging and reading a longer draft cost a little more), and for one
    session it may overlap the draft wait's own share of it. ``limits`` (the verifier's batch
    limits) split more sessions than one forward takes over several forwards, each paying its fixed
    cost (none: the paper's one batch of every running request)."""
    extra_one = overhead.predict(1) if overhead else 0.0
    out = []
    for k in range(max_len + 1):
        one = SegmentShape(new=1 + k, cached=context)
        per_step = sessions if limits is None else min(limits.max_sessions, limits.max_tokens // (1 + k))
        everyone = verify_all(model, one, sessions, per_step, overhead)
        # a lookahead drafts while the session's own step is verified (draft_wait.Timed)
        head_start = verify_all(model, one, min(sessions, max(1, per_step)), per_step, overhead)
        waited = wait.predict(k, sessions, alpha, head_start)
        rest = wait.rest(sessions) if k > 0 else 0.0  # a speculating round's own (plain decoding's is in overhead)
        seconds = max(everyone, waited + model.predict([one]) + extra_one + rest)
        out.append(sessions * expected_tokens(alpha, k) / max(seconds, 1e-9))
    return out


def verify_all(model: StepTimeModel, one: SegmentShape, sessions: int, per_step: int,
               overhead: RecentLine | None = None) -> float:
    """The verifier's time for a round of ``sessions`` alike segments ``one``, in forwards of at
    most ``per_step`` of them (at least one: the batcher takes a first segment over the token
    limit too), each with the busy time between forwards (``overhead``). Eq. 19 is affine in its
    sums, so m alike segments cost T(1) plus m - 1 times the second one's extra."""
    per_step = max(1, per_step)
    first = model.predict([one])
    second = model.predict([one, one]) - first

    def step(m: int) -> float:
        return first + (m - 1) * second + (overhead.predict(m) if overhead else 0.0)

    full, rest = divmod(sessions, per_step)
    return full * step(per_step) + (step(rest) if rest else 0.0)


def best_length(alpha: float, sessions: int, context: int, max_len: int, model: StepTimeModel,
                wait: DraftWaitModel, current: int | None = None, margin: float = 0.0,
                overhead: RecentLine | None = None, limits: BatchLimits | None = None) -> tuple[int, float]:
    """(k, goodput) maximising eq. 3's goodput over k in 0…max_len; with ``current``, it stays
    unless the best k predicts ``margin`` (a fraction) more goodput than it."""
    g = goodputs(alpha, sessions, context, max_len, model, wait, overhead, limits)
    best = max(range(len(g)), key=g.__getitem__)
    if current is not None and 0 <= current < len(g) and g[best] <= g[current] * (1 + margin):
        return current, g[current]
    return best, g[best]


class SmartSpecAllocator:
    name = "smartspec"

    def __init__(self, model: StepTimeModel, draft_len: int, max_len: int = 8, window: int = 16,
                 alpha0: float = 0.5, overhead: RecentLine | None = None,
                 limits: BatchLimits | None = None, timed_waits: bool = True) -> None:
        if draft_len < 0 or max_len < 0 or window < 1:
            raise ValueError("draft_len and max_len must be >= 0 and window >= 1")
        self.model, self.max_len, self.alpha0 = model, max_len, alpha0
        self.overhead = overhead  # the verifier's busy time between forwards (None: not priced)
        self.limits = limits  # the verifier's batch limits (None: one forward takes every session)
        self.last_k = min(draft_len, max_len)
        self.explore_k = max(1, self.last_k) if max_len > 0 else 0  # what warm-up rounds and probes draft
        self._off_steps = 0
        self._chosen: int | None = None  # the length the estimates last chose (probes aside)
        self._context = 0  # the mean context of the last verified batch
        #: each live session's previous verified round: (drafts, whether all were accepted, when it ended)
        self._drafted: dict[str, tuple[int, bool, float]] = {}
        self.last_goodput = 0.0
        self.wait = DraftWaitModel()
        self.timed_waits = timed_waits  # False: the drafters' timings are not used (the level-and-slope waits)
        self._tests: deque[tuple[int, int]] = deque()  # (accepted, tested) of recent drafted steps
        self._sums = (0, 0)  # their (accepted, tested), replaced whole: the event loop reads it
        self._steps = 0  # drafted steps seen: ``window`` of them are the evidence to decide on
        self.window = window
        #: (when, live sessions) of recent steps, each live count above every later one's, so the
        #: first not older than WAIT_HORIZON_S is the peak since; ``loads`` is a copy of it, replaced
        #: whole for the event loop's reads (:meth:`peak`)
        self._loads: deque[tuple[float, int]] = deque()
        self.loads: tuple[tuple[float, int], ...] = ()

    def initial(self, session_id: str, tracker: GoodputTracker) -> int:
        self._drafted.pop(session_id, None)  # opened or resumed: its next draft is a first one
        return self.last_k

    def alpha(self) -> float:
        """Accepted over tested drafts in the recent steps (``alpha0`` before any)."""
        accepted, tested = self._sums
        return accepted / tested if tested else self.alpha0

    def beliefs(self) -> dict[str, float]:
        """What the choice rests on: the acceptance estimate and the draft waits (the line over every
        load, and each load band's level under one slope: ``draft_wait_band3_s`` for 4-7 live sessions)."""
        out = {"alpha": round(self.alpha(), 4), "draft_wait_e0_s": round(self.wait.e0, 6),
               "draft_wait_e1_s": round(self.wait.e1, 6)}
        slope, levels = self.wait.fit
        out |= {"draft_wait_band_slope_s": round(slope, 6)}
        out |= {f"draft_wait_band{b}_s": round(v, 6) for b, v in sorted(levels.items())}
        for b, t in sorted(self.wait.timed.items()):  # the drafter-timed parts (draft_wait.Timed)
            out |= {f"draft_wait_band{b}_net_s": round(t.net, 6), f"draft_wait_band{b}_rest_s": round(t.rest, 6),
                    f"draft_wait_band{b}_per_token_s": round(t.per_token, 6),
                    f"draft_wait_band{b}_ahead": round(t.ahead, 4)}
        out["live_peak"] = float(self.peak())  # the most live sessions of a step in the last WAIT_HORIZON_S
        if self.overhead is not None:
            out |= {"overhead_e0_s": round(self.overhead.e0, 6), "overhead_e1_s": round(self.overhead.e1, 7)}
        return out

    def _observe_wait(self, r: RoundStats, live: int, full: bool, rest: float) -> None:
        """One round's draft wait into the wait model: with the drafter's timings, or (``timed_waits``
        off) the wait alone."""
        if self.timed_waits:
            self.wait.observe(r.drafted, r.draft_wait_s, live, r.drafting_s, r.ahead, full, rest)
        else:
            self.wait.observe(r.drafted, r.draft_wait_s, live)

    def assign(self, rounds: Sequence[RoundStats], tracker: GoodputTracker) -> dict[str, int]:
        accepted = tested = 0
        live, now = max(len(rounds), len(tracker.sessions)), self.wait.clock()
        self._note_load(live)
        for r in rounds:
            # not a first round, nor the first after a pause, nor a probe's: a probe's drafter
            # drafts only now and then, and waited longer (at 6 requests/s: 9 ms, against 5-7 ms
            # while speculating), which would keep speculation off
            before, full, then = self._drafted.get(r.session_id, (0, False, now))
            if before > 0 and self._chosen != 0:
                self._observe_wait(r, live, full, now - then - r.draft_wait_s - self._verified(r, len(rounds)))
            self._drafted[r.session_id] = (r.drafted, 0 < r.drafted <= r.accepted, now)
            accepted += r.accepted
            tested += judged(r.drafted, r.accepted)
        self.wait.expire()
        if tested > 0:
            self._count_tests(accepted, tested)
        if len(self._drafted) > 2 * len(tracker.sessions) + 64:
            self._drafted = {sid: d for sid, d in self._drafted.items() if sid in tracker.sessions}
        if not rounds:
            return {}
        # the paper's batch holds every running request; here a step holds the sessions whose
        # drafts are in, so plan for all live sessions, at this batch's mean context
        self._context = sum(r.context_len for r in rounds) // len(rounds)
        if self.wait.timing():  # too few timed drafts to price a length by yet: hold it, choose none
            self._chosen, self.last_k = None, self.explore_k
            return {r.session_id: self.explore_k for r in rounds}
        k, self.last_goodput = best_length(self.alpha(), live, self._context, self.max_len, self.model,
                                           self.wait, self._chosen, TIMED_MARGIN if self.wait.timed else SWITCH_MARGIN,
                                           self.overhead, self.limits)
        self._chosen = k
        self._off_steps = self._off_steps + 1 if k == 0 else 0
        if self._steps < self.window or self._off_steps % PROBE_EVERY >= PROBE_EVERY - PROBE_STEPS:
            k = self.explore_k  # too little evidence yet, or a probe of a switched-off speculation
        self.last_k = k
        return {r.session_id: k for r in rounds}

    def _verified(self, r: RoundStats, batch: int) -> float:
        """A round's time from its draft's arrival to its verdict: as the core measured it (its queue
        behind the other sessions' steps and its own step's whole forward: :func:`verify_all` prices
        those, so ``rest`` must not count them again), else as priced: its forward in a step of
        ``batch``, and the busy time around it."""
        if r.verify_s is not None:
            return r.verify_s
        one = SegmentShape(new=1 + r.drafted, cached=r.context_len)
        return self.model.predict([one]) + (self.overhead.predict(batch) if self.overhead else 0.0)

    def peak(self) -> int:
        """The most live sessions of a step with a speculating round in the last WAIT_HORIZON_S
        (the draft waits' horizon and clock; a read: safe from the event loop). Steps of
        target-only rounds alone do not call ``assign``: once every live session is target-only,
        the peak expires and the sessions live now count."""
        cutoff = self.wait.clock() - self.wait.horizon_s
        return next((live for when, live in self.loads if when >= cutoff), 0)

    def _note_load(self, live: int) -> None:
        """Add a step's live sessions to ``loads`` (the engine core's thread only)."""
        now = self.wait.clock()
        while self._loads and self._loads[-1][1] <= live:
            self._loads.pop()
        self._loads.append((now, live))
        while self._loads[0][0] < now - self.wait.horizon_s:
            self._loads.popleft()
        self.loads = tuple(self._loads)

    def _count_tests(self, accepted: int, tested: int) -> None:
        """Add a drafted step's tests, dropping the oldest steps beyond ALPHA_TESTS tested drafts."""
        self._tests.append((accepted, tested))
        self._steps += 1
        a_sum, t_sum = self._sums[0] + accepted, self._sums[1] + tested
        while len(self._tests) > 1 and t_sum - self._tests[0][1] >= ALPHA_TESTS:
            a, t = self._tests.popleft()
            a_sum, t_sum = a_sum - a, t_sum - t
        self._sums = (a_sum, t_sum)

    def draft_share(self, tracker: GoodputTracker) -> float:
        """The share of requests arriving now that should get a drafter: all while the best length
        for the live sessions (below) is above 0, else none. Unlike ``assign``'s
        step by step choice this one lasts: a request opened target-only stays so to its end, 1-2 s
        at 48 requests/s. So the live sessions are the most any step had in the last
        WAIT_HORIZON_S, the load it will likely live through: priced at the sessions live when it
        arrived, the first of a burst's (16-31 at 48 requests/s, at 36-40 ms draft waits) found
        plain decoding as good, and 18 % of a run's requests were opened target-only (TPOT p90
        34.5 ms against fixed k = 5's 21.1; 1.39x no speculation against its 1.78x). The mean
        step's live sessions instead, tried too, likely fell among those 16-31 as bursts filled
        and drained the verifier (not measured), and drafted for 75 % and 73 % at 48 and 64
        requests/s (1.14x and 1.64x, 14:43). Without the margin
        ``assign`` keeps against flipping: a request not yet started loses no lookahead, and at 48
        requests/s the margin kept 91 % of them on the drafter at 28-38 ms draft waits (0.92x
        no speculation). Unlike ``assign`` this needs no speculating round: with new requests
        target-only it turns back on once the load has been lower for WAIT_HORIZON_S, or once
        the draft waits it decided on have expired (then no wait is assumed, and the requests sent
        to drafters measure it again). All while the evidence is too thin to tell."""
        if self.max_len == 0 or self._steps < self.window:
            return 1.0 if self.max_len > 0 else 0.0
        wait = NO_WAIT if self.wait.stale() else self.wait
        live = max(len(tracker.sessions) + 1, self.peak())
        k, _ = best_length(self.alpha(), live, self._context, self.max_len, self.model,
                           wait, overhead=self.overhead, limits=self.limits)
        return 1.0 if k > 0 else 0.0
