"""The simulated verifier: admission, batch selection, judging, allocation, verdicts.

It mirrors ``services/verifier/core.py`` and ``scheduler.py`` step for step, calling the real
policies (never copies of them):

* admission (``_admit``/``_initial_budget``): ``tracker.open`` for a speculative session, then
  ``min(allocator.initial(sid, tracker), max_draft_tokens)`` and ``tracker.set_budget``; a budget
  of 0 makes the session ready at once (target-only round), otherwise it waits for its draft;
* batch selection (``Scheduler._add_verify``/``_candidate``): a :class:`Candidate` per ready
  session, ``expected_tokens(α̂, drafts)`` from the tracker, then the real ``batcher.select``
  under :class:`BatchLimits`; WISP's clock is the simulated clock;
* a step (``_step``/``_next_budgets``/``_publish_round``): its time from the cost model plus
  fixed overheads, which feed the overhead line SmartSpec prices rounds with, as the core's
  measured busy time between forwards does; each round accepts its drafts' accepted prefix and commits it plus one token
  (up to max_tokens); the rounds of unfinished speculative sessions go to ``tracker.observe``,
  then ``allocator.assign`` gives next budgets (capped, ``tracker.set_budget``), finished
  sessions are forgotten, and verdicts leave for the drafters (RTT/2 away).

Simplifications: the whole prompt is fed in the session's first round (no chunked prefill, no
separate prefill steps); the KV cache and the session count are unbounded (no admission queue);
a candidate is built once, when its session becomes ready (the real scheduler rebuilds it every
step from the same values: nothing it reads changes while the session waits).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bench.sim.costs import CostModel
from bench.sim.result import Recorder
from bench.sim.spec import SimSpec
from bench.sim.state import Events, Kind, Session, Step, Verdict
from bench.sim.tokens import accepted_prefix
from services.verifier.allocation import AllocationSettings, GoodputTracker, RoundStats, make_allocator
from services.verifier.allocation.goodspeed import expected_tokens
from services.verifier.batching import BatchLimits, Candidate, WispBatcher, make_batcher
from services.verifier.batching.estimator import RecentLine, SegmentShape


class SimVerifier:
    """The verifier's loop over simulated time (one forward pass at a time)."""

    def __init__(self, spec: SimSpec, cost: CostModel, events: Events, rec: Recorder,
                 clock: Callable[[], float]) -> None:
        p, v = spec.policies, spec.verifier
        self.speculative, self.cost, self.events, self.rec, self.v = spec.speculative, cost, events, rec, v
        self.tracker = GoodputTracker(p.goodspeed_eta, p.goodspeed_beta)
        self.overhead = RecentLine(window=512, refit_every=32)  # as the core: busy time between forwards
        self.allocator = make_allocator(p.allocation, AllocationSettings(
            p.draft_len, p.capacity, p.allocation_max_len, spec.seed), cost, self.overhead)
        self.batcher = make_batcher(p.batching, cost, p.default_slo_tokens_per_s, delta_s=p.wisp_delta_s,
                                    network_s=p.wisp_network_s)
        if isinstance(self.batcher, WispBatcher):
            self.batcher.clock = clock  # deadlines and latest starts on the simulated clock
        self.limits = BatchLimits(v.max_sessions, v.max_tokens)
        self.max_draft = p.max_draft_tokens
        self.ready: dict[str, tuple[Session, Candidate]] = {}
        self.busy = False
        self.budget_sum = 0  # Σ budgets held in the tracker, kept incrementally

    # --- budgets -----------------------------------------------------------------------------

    def _set_budget(self, sid: str, budget: int) -> None:
        est = self.tracker.sessions.get(sid)
        if est is not None:
            self.budget_sum += budget - est.budget
        self.tracker.set_budget(sid, budget)

    def _forget(self, sid: str) -> None:
        est = self.tracker.sessions.get(sid)
        if est is not None:
            self.budget_sum -= est.budget
        self.tracker.forget(sid)

    def _note_budgets(self) -> None:
        self.rec.max_budget_sum = max(self.rec.max_budget_sum, self.budget_sum)

    # --- admission ---------------------------------------------------------------------------

    def admit(self, s: Session, now: float) -> None:
        """The session's open message arrived: register it and hand out its first budget."""
        s.opened_at = now
        if not self.speculative:
            self.mark_ready(s, now)
            return
        self.tracker.open(s.sid, s.edge.name)
        started = time.perf_counter()
        initial = self.allocator.initial(s.sid, self.tracker)
        self.rec.admit_s.append(time.perf_counter() - started)
        s.budget = min(initial, self.max_draft)
        self._set_budget(s.sid, s.budget)
        self._note_budgets()
        if s.budget > 0:
            s.waiting_since = now
            self.events.push(now + s.edge.half_rtt, Kind.VERDICT, Verdict(s, 0, 0, False, s.budget))
        else:
            self.mark_ready(s, now)

    def mark_ready(self, s: Session, now: float) -> None:
        """Its draft arrived, or its round is target-only: a candidate for the next steps."""
        est = self.tracker.sessions.get(s.sid)
        n = len(s.drafts)
        expected = expected_tokens(est.alpha, n) if est is not None else 1.0
        to_prefill = s.context_len - 1 - s.cached
        self.ready[s.sid] = (s, Candidate(s.sid, to_prefill + 1 + n, s.context_len, now, cached=s.cached,
                                          arrived_at=s.arrived_at, generated=s.generated, slo_tokens_per_s=s.slo,
                                          expected_tokens=expected))

    # --- a step ------------------------------------------------------------------------------

    def try_start(self, now: float) -> None:
        """When idle with ready sessions: select a batch and start its forward pass."""
        if self.busy or not self.ready:
            return
        candidates = [c for _, c in self.ready.values()]
        started = time.perf_counter()
        chosen = self.batcher.select(candidates, self.limits)
        select_s = time.perf_counter() - started
        picked = [self.ready.pop(sid) for sid in chosen]
        shapes = [SegmentShape(new=c.new_tokens, cached=c.cached) for _, c in picked]
        overhead = self.v.step_overhead_s + self.v.round_overhead_s * len(picked)
        self.overhead.observe(len(picked), overhead)
        seconds = self.cost.predict(shapes) + overhead
        self.busy = True
        self.events.push(now + seconds, Kind.STEP_END, Step(tuple(s for s, _ in picked), seconds, select_s))

    def end_step(self, step: Step, now: float) -> None:
        """The forward pass finished: judge, commit, allocate and send the verdicts."""
        self.busy = False
        judged = [self._judge(s) for s in step.sessions]
        rounds = [RoundStats(s.sid, s.edge.name, drafted, accepted, s.context_len, prob, s.draft_wait_s)
                  for s, drafted, accepted, prob in judged if self.speculative and not s.finished]
        for r in rounds:
            self.tracker.observe(r)
        started = time.perf_counter()
        budgets = self.allocator.assign(rounds, self.tracker) if rounds else {}
        assign_s = time.perf_counter() - started
        for sid, budget in budgets.items():
            self._set_budget(sid, min(budget, self.max_draft))
        self._note_budgets()
        self.rec.step(len(step.sessions), step.seconds, step.select_s, assign_s)
        for s, drafted, accepted, _ in judged:
            self._publish(s, drafted, accepted, budgets.get(s.sid, 0), now)

    def _judge(self, s: Session) -> tuple[Session, int, int, float]:
        """Accept the longest accepted prefix, commit it plus the target's own token."""
        drafted = len(s.drafts)
        accepted = accepted_prefix([ok for _, ok in s.drafts])
        prob = sum(a for a, _ in s.drafts)  # Σ min(1, p/q) over every draft (GoodSpeed eq. 3)
        committed = min(accepted + 1, s.remaining)
        s.cached = s.context_len + accepted  # KV rolled back past the rejected drafts
        s.generated += committed
        s.finished = s.generated >= s.max_tokens
        self.rec.round(s.edge.index, drafted, accepted, committed, s.asked)
        return s, drafted, accepted, prob

    def _publish(self, s: Session, drafted: int, accepted: int, budget: int, now: float) -> None:
        budget = 0 if s.finished or not self.speculative else min(budget, self.max_draft)
        arrive = now + s.edge.half_rtt
        if s.first_token_at is None:
            s.first_token_at = arrive
        if s.finished or drafted > 0 or budget > 0:  # the drafter hears of it (a target-only round: only at the end)
            self.events.push(arrive, Kind.VERDICT, Verdict(s, drafted, accepted, s.finished, budget))
        s.budget, s.drafts, s.asked = budget, [], 0
        if s.finished:
            self._forget(s.sid)
        elif budget > 0:
            s.waiting_since = now
        else:
            self.mark_ready(s, now)
