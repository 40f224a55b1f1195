"""The simulated verifier: admission, batch selection, judging, allocation, verdicts.

It follows the torch core (``services/verifier/core.py``, ``request_table.py``, ``scheduler.py``
and ``round/``) step for step, calling the real policies and the round's own bookkeeping (never
copies of them):

* admission (``RequestTable.admit``): the real ``DraftBudgets.open`` (``round/budgets.py``) gives
  a speculative session its first budget; a budget of 0 makes the session ready at once
  (target-only round), otherwise it waits for its draft;
* batch selection (``Scheduler._add_verify``/``_candidate``): a :class:`Candidate` per ready
  session, ``expected_tokens(α̂, drafts)`` from the tracker, then the real ``batcher.select``
  under :class:`BatchLimits`; WISP's clock, and SmartSpec's, is the simulated clock;
* a step (``TorchCore._step``, ``RoundLifecycle.close``): its time from the cost model plus
  fixed overheads, which feed the overhead line SmartSpec prices rounds with (as the core's
  measured busy time between forwards does); each round accepts its drafts' accepted prefix and
  commits it plus one token (up to max_tokens); the rounds of unfinished speculative sessions
  go to ``DraftBudgets.next`` (the tracker learns, the allocator assigns the next budgets,
  capped), finished sessions are forgotten, and verdicts leave for the drafters
  (RTT/2 away);
* filling (``VerifierSpec.fill``; ``Scheduler._add_fill``, ``RoundLifecycle._fill``,
  ``round.draft.settle``): with nothing ready to verify, the real :class:`FillBeforeDrafts` picks
  waiting sessions past their first round to decode one token each, and when none may go now the
  verifier looks again once a waiting draft turns late; a step that verifies others takes the
  waiting sessions that fit as riders, one token each (``Scheduler._add_riders``, the real
  ``Fill.riders``; ``VerifierSpec.riders``). A draft that arrives during its
  session's fill step is taken when the step ends; its leading drafts are matched against the
  fill (a draft token equals the target's exactly when it is accepted) and settled or verified by
  the real ``settled_drafts`` and ``filled_outcome``. A session the fill finishes ends its round
  there. Every session is taken as deterministic (greedy or raced), which filling needs;
* conditional drafts (``take_conditional``; ``round/conditional.py``):
  one that arrives before the round it assumes ends is held and taken when that round ends as it
  assumed, one that arrives later is taken if the session still waits for that round's draft; its
  wait does not feed the fill policy, as the real one's does not.

Simplifications: the whole prompt is fed in the session's first round (no chunked prefill, no
separate prefill steps, so no fill before it); the KV cache and the session count are unbounded
(no admission queue); a candidate is built once, when its session becomes ready (the real scheduler rebuilds it every
step from the same values: nothing it reads changes while the session waits).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

from bench.sim.costs import CostModel
from bench.sim.result import Recorder
from bench.sim.spec import SimSpec
from bench.sim.state import Events, Kind, Lookahead, Session, Step, Verdict
from bench.sim.tokens import accepted_prefix
from services.verifier.allocation import (
    AllocationSettings,
    GoodputTracker,
    RoundStats,
    SmartSpecAllocator,
    make_allocator,
)
from services.verifier.allocation.base import expected_tokens
from services.verifier.batching import BatchLimits, Candidate, DeadlineBatcher, SloClock, make_batcher
from services.verifier.batching.estimator import SegmentShape, overhead_line
from services.verifier.fill import make_fill
from services.verifier.round import DraftBudgets, filled_outcome, settled_drafts
from services.verifier.scheduler import choose_riders


class SimVerifier:
    """The verifier's loop over simulated time (one forward pass at a time)."""

    def __init__(self, spec: SimSpec, cost: CostModel, events: Events, rec: Recorder,
                 clock: Callable[[], float], rng: random.Random) -> None:
        p, v = spec.policies, spec.verifier
        self.speculative, self.cost, self.events, self.rec, self.v = spec.speculative, cost, events, rec, v
        self.rng = rng  # the links' jitter (``Edge.carry``)
        self.tracker = GoodputTracker(p.goodspeed_eta, p.goodspeed_beta)
        self.overhead = overhead_line()  # as the core's: busy time between forwards
        self.limits = BatchLimits(v.max_sessions, v.max_tokens)
        self.allocator = make_allocator(p.allocation, AllocationSettings(
            p.draft_len, p.capacity, p.allocation_max_len, spec.seed, self.limits), cost, self.overhead)
        self.batcher = make_batcher(p.batching, cost, p.default_slo_tokens_per_s, delta_s=p.wisp_delta_s,
                                    network_s=p.wisp_network_s)
        if isinstance(self.batcher, DeadlineBatcher):
            self.batcher.clock = clock  # deadlines and latest starts on the simulated clock
        if isinstance(self.allocator, SmartSpecAllocator):
            self.allocator.wait.clock = clock  # its draft waits expire in simulated time
        self.budgets = DraftBudgets(self.allocator, self.tracker, p.max_draft_tokens)  # the real bookkeeping
        self.max_draft = p.max_draft_tokens
        self.ready: dict[str, tuple[Session, Candidate]] = {}
        self.fill = make_fill(v.fill and spec.speculative, v.riders)  # the real fill policy
        self.waiting: dict[str, Session] = {}  # sessions whose round waits for its draft
        self.filling: set[str] = set()  # sessions of the fill step in flight
        #: their drafts, which arrived during it: taken when it ends (a conditional one with its lookahead)
        self.held: list[tuple[Session, Lookahead | None]] = []
        self.wake_at: float | None = None
        self.busy = False

    def _note_budgets(self) -> None:
        self.rec.max_budget_sum = max(self.rec.max_budget_sum, self.budgets.total)

    # --- admission ---------------------------------------------------------------------------

    def admit(self, s: Session, now: float) -> None:
        """The session's open message arrived: register it and hand out its first budget."""
        s.opened_at = now
        if not s.speculative:
            if self.speculative:  # opened target-only beside speculating ones: it shares their steps
                self.budgets.attach(s.sid, None)
            self.mark_ready(s, now)
            return
        s.budget = self.budgets.open(s.sid, s.edge.name)
        self.rec.admit_s.append(self.budgets.initial_s)
        self._note_budgets()
        if s.budget > 0:
            self._await_draft(s, now)
            self.events.push(s.edge.carry(now, False, self.rng), Kind.VERDICT, Verdict(s, 0, 0, False, s.budget))
        else:
            self.mark_ready(s, now)

    def _await_draft(self, s: Session, now: float) -> None:
        s.waiting_since, s.waiting_draft, s.filled, s.matched, s.sent = now, True, 0, 0, 0
        self.waiting[s.sid] = s

    def take_conditional(self, s: Session, ahead: Lookahead, now: float) -> None:
        """A lookahead sent before the verdict it assumes (``round/conditional.py``): held for the
        end of that round when it is still to come, taken at once when that verdict already went
        out with a budget and came true, otherwise dropped."""
        if s.finished:
            return
        if ahead.round == s.round:
            s.upcoming = ahead  # the real verifier holds up to 8; the simulated drafter sends one
        elif ahead.round + 1 == s.round and ahead.hit:
            self.take_draft(s, now, ahead)

    def take_draft(self, s: Session, now: float, conditional: Lookahead | None = None) -> None:
        """The round's draft reached the verifier (``round.draft.settle``): the leading drafts the
        fill already committed are matched (a draft token equals the target's exactly when it is
        accepted), the rest are verified after the fill, and a draft that left the fill verifies
        nothing. A draft arriving during a fill step of its session waits for that step's end, as
        the real verifier reads its commands between steps (its wait, as the real one's, counts
        to when it is taken); one for a request the fill finished is dropped. A ``conditional``
        draft (a lookahead that came true) is cut to the round's budget, and its wait is not one the
        fill policy learns from (nor the real one's)."""
        if not s.waiting_draft:
            return
        if s.sid in self.filling:
            self.held.append((s, conditional))
            return
        s.draft_wait_s = now - s.waiting_since
        if conditional is not None:
            s.drafts = conditional.draft(s.budget)
            s.asked = min(s.budget, conditional.tokens)  # what it asked its proposer for, within the budget
            self.rec.conditional_taken += 1
        else:
            self.rec.fill_wait(s.edge.index, s.draft_wait_s, self.fill.observe(s.drafter, s.draft_wait_s))
        s.sent, s.waiting_draft = len(s.drafts), False
        self.waiting.pop(s.sid, None)
        s.matched = accepted_prefix([ok for _, ok in s.drafts[: s.filled]])
        s.drafts = s.drafts[settled_drafts(s.sent, s.filled, s.matched) :]
        if s.matched < s.filled:
            # the round ends past the draft: its lookahead guessed a text that did not come (the
            # real drafter keeps one only if it also predicted the fill beyond its draft)
            s.fill_broke = s.round
            if s.ahead is not None and s.ahead.round == s.round:
                s.ahead.hit = False
        self.mark_ready(s, now)

    def mark_ready(self, s: Session, now: float) -> None:
        """Its draft arrived, or its round is target-only: a candidate for the next steps."""
        est = self.tracker.sessions.get(s.sid)
        n = len(s.drafts)
        expected = expected_tokens(est.alpha, n) if est is not None else 1.0
        to_prefill = s.context_len - 1 - s.cached
        clock = SloClock(s.arrived_at, s.generated, s.slo)
        self.ready[s.sid] = (s, Candidate(s.sid, to_prefill + 1 + n, s.context_len, now, cached=s.cached, clock=clock,
                                          expected_tokens=expected))

    # --- a step ------------------------------------------------------------------------------

    def try_start(self, now: float) -> None:
        """When idle with ready sessions: select a batch and start its forward pass; with none, a
        fill step if the fill policy finds one (``Scheduler._add_fill``)."""
        if self.busy:
            return
        if not self.ready:
            self._try_fill(now)
            return
        candidates = [c for _, c in self.ready.values()]
        started = time.perf_counter()
        chosen = self.batcher.select(candidates, self.limits)
        select_s = time.perf_counter() - started
        picked = [self.ready.pop(sid) for sid in chosen]
        shapes = [SegmentShape(new=c.new_tokens, cached=c.cached) for _, c in picked]
        riders = tuple(choose_riders(self.fill, self.batcher, self.limits, list(self.waiting.values()), len(picked),
                                     sum(c.new_tokens for _, c in picked)))  # as ``Scheduler._add_riders``
        self.filling = {s.sid for s in riders}
        shapes += [SegmentShape(new=1, cached=s.cached) for s in riders]
        self._start(tuple(s for s, _ in picked), shapes, now, select_s, riders=riders)

    def _try_fill(self, now: float) -> None:
        """One token for each waiting session the real fill policy picks; when it picks none, look
        again once a waiting session's draft turns late (``Scheduler.fill_wait_s``)."""
        if not self.waiting:
            return
        waiting = list(self.waiting.values())
        started = time.perf_counter()
        chosen = self.fill.choose(waiting, self.cost, now, min(self.limits.max_sessions, self.limits.max_tokens))
        select_s = time.perf_counter() - started
        if not chosen:
            later = self.fill.next_change(waiting, now)
            # just past the turn: at it, rounding may still count the draft as due
            wake = math.nextafter(now + later, math.inf) if later is not None else None
            if wake is not None and (self.wake_at is None or self.wake_at <= now or wake < self.wake_at):
                self.wake_at = wake
                self.events.push(wake, Kind.WAKE, None)
            return
        shapes = [SegmentShape(new=1, cached=s.cached) for s in chosen]  # fillable: all but the last token cached
        self.filling = {s.sid for s in chosen}
        self._start(tuple(chosen), shapes, now, select_s, fill=True)

    def _start(self, sessions: tuple[Session, ...], shapes: list[SegmentShape], now: float, select_s: float,
               fill: bool = False, riders: tuple[Session, ...] = ()) -> None:
        rows = len(sessions) + len(riders)
        overhead = self.v.step_overhead_s + self.v.round_overhead_s * rows
        self.overhead.observe(rows, overhead)
        seconds = self.cost.predict(shapes) + overhead
        self.busy = True
        self.events.push(now + seconds, Kind.STEP_END, Step(sessions, seconds, select_s, fill, riders))

    def end_step(self, step: Step, now: float) -> None:
        """The forward pass finished: judge, commit, allocate and send the verdicts (a fill step:
        commit one token each, then take the drafts that arrived meanwhile)."""
        self.busy = False
        if step.fill:
            self._end_fill(step, now)
            return
        judged = [self._judge(s) for s in step.sessions]
        rounds = [RoundStats(s.sid, s.edge.name, drafted, accepted, s.context_len, prob, s.draft_wait_s)
                  for s, drafted, accepted, prob in judged if s.speculative and not s.finished]
        budgets = self.budgets.next(rounds)
        self._note_budgets()
        self.rec.step(len(step.sessions) + len(step.riders), step.seconds, step.select_s, self.budgets.assign_s)
        for s, drafted, accepted, _ in judged:
            self._publish(s, drafted, accepted, budgets.get(s.sid, 0), now)
        self._commit_fills(step.riders, now)

    def _end_fill(self, step: Step, now: float) -> None:
        self.rec.step(len(step.sessions), step.seconds, step.select_s, 0.0)
        self._commit_fills(step.sessions, now)

    def _commit_fills(self, sessions: tuple[Session, ...], now: float) -> None:
        """One target-only token for each session filled (a fill step's, or a step's riders), then
        the drafts that arrived for them meanwhile."""
        self.filling = set()
        for s in sessions:
            s.cached += 1  # the step fed its last token and decoded one more
            s.generated += 1
            s.filled += 1
            s.finished = s.generated >= s.max_tokens
            self.rec.fill(s.edge.index)
            if s.first_token_at is None:  # streamed to the client at once (``Filled``)
                s.first_token_at = now + s.edge.half_rtt
            if s.finished:  # the round ends here: its draft is moot (``RoundLifecycle._fill``)
                s.waiting_draft = False
                self.waiting.pop(s.sid, None)
                self.rec.round(s.edge.index, 0, 0, 0, 0)
                self._publish(s, 0, 0, 0, now)
        held, self.held = self.held, []
        for s, conditional in held:
            self.take_draft(s, now, conditional)

    def _judge(self, s: Session) -> tuple[Session, int, int, float]:
        """Accept the longest accepted prefix, commit it plus the target's own token; with a fill,
        the round as a whole (``Round.outcome``): matched drafts count as accepted ones,
        a draft that left the fill as one rejected draft after them."""
        verified = len(s.drafts)
        accepted = accepted_prefix([ok for _, ok in s.drafts])
        prob = sum(a for a, _ in s.drafts)  # Σ min(1, p/q) over every draft (GoodSpeed eq. 3)
        committed = min(accepted + 1, s.remaining)
        s.cached = s.context_len + accepted  # KV rolled back past the rejected drafts
        s.generated += committed
        s.finished = s.generated >= s.max_tokens
        drafted, accepted, prob = filled_outcome(s.filled, s.matched, s.sent, verified, accepted, prob)
        self.rec.round(s.edge.index, drafted, accepted, committed, s.asked)
        return s, drafted, accepted, prob

    def _publish(self, s: Session, drafted: int, accepted: int, budget: int, now: float) -> None:
        budget = 0 if s.finished or not s.speculative else min(budget, self.max_draft)
        heard = s.finished or drafted > 0 or budget > 0  # the drafter hears (a target-only round: only at the end)
        arrive = s.edge.carry(now, False, self.rng) if heard else now + s.edge.half_rtt  # else: to the client only
        if s.first_token_at is None:
            s.first_token_at = arrive
        if heard:
            self.events.push(arrive, Kind.VERDICT, Verdict(s, drafted, accepted, s.finished, budget, s.round))
        s.budget, s.drafts, s.asked = budget, [], 0
        s.round += 1
        upcoming, s.upcoming = s.upcoming, None
        if s.finished:
            self.budgets.forget(s.sid)
        elif budget > 0:
            self._await_draft(s, now)
            if upcoming is not None and upcoming.hit:  # the round ended as its conditional draft assumed
                self.take_draft(s, now, upcoming)
        else:
            s.filled = 0
            self.mark_ready(s, now)
