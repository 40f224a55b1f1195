"""The discrete-event loop and the drafters' side; :func:`simulate` runs a :class:`SimSpec`.

Drafters (mirroring ``services/drafter/rounds.py`` and ``batcher.py``): a verdict (or the
admission) with budget b > 0 makes the session ready on its drafter's one draft model. When the
model is free it takes every ready session (up to ``max_batch``, oldest first) as one batch, as
the real batcher does. For each, the drafter caps b at what the request can still use
(``useful_draft_len``: at most ``max_tokens − generated − 1``), asks the real controller
(``begin_round``), and drafts token by token: each synthetic token (``tokens.py``) is shown to
``on_step`` when the controller wants features, which may stop early (STOP keeps the token,
DISCARD drops it; its compute is spent). The batch takes a forward's fixed cost per draft
position (its longest draft's) plus its sessions' draft costs (``DrafterSpec``), and every draft
of it leaves after its hand-off (``send_s``; with ``send_rows``, one after another), reaching
the verifier RTT/2 later. Pipelined drafting (``lookahead.py``): a session that sends a draft
while its drafter serves at most ``pipeline_sessions`` sessions drafts its next round ahead, as
if this one is accepted whole, one token per batch and only while no round is ready. A verdict
that makes it true takes it as the next draft, sent once it is done; any other drops it.
Conditional drafts (``DrafterSpec.conditional``): a lookahead done before its verdict came
leaves at once (cut where the session's controller would stop it, ``DraftController.keeps``),
and the verifier verifies it as soon as the round it assumes ends as assumed (or when it
arrives, if later); the drafter, hearing that verdict, starts the next round with it (sending
nothing) and looks ahead past it, as the real one does (``Lookahead.presented``). When the
verdict comes back, ``end_round(drafted, accepted, draft_s, verify_s)`` feeds the controller, as
the real drafter does. The controller's decisions are taken when the draft starts (the simulator
draws the whole draft at once), so feedback from other sessions' verdicts during a draft is seen
from the next one.

Shared edge cores (``SimSpec.edge_cores``): batches and lookahead steps are jobs on the drafters'
shared cores instead (``edge_cpu.py``), ending when their CPU work is done. Measured spreads
(``DrafterSpec.draft_spread``, ``send_spread``): a round batch's time and a draft's hand-off are
their mean times a draw of mean 1 from the real drafter's histogram (``spread.py``).

Requests: a request starts at its drafter (client), its open message reaches the verifier RTT/2
later; its last tokens come back RTT/2 after its last step. Closed loop: the first requests
start at their drafter's ``starts`` (all at 0 without), and the next request the moment one
finishes (no think time), at the same drafter; with ``shared_requests`` the drafters draw from
one pool, as the real ones do from the request queue. Latency, TTFT, TPOT and SLO attainment
(the real ``slo_met``) are measured at the client, from its arrival there to its tokens' return.

Events at the same instant are all handled before the verifier picks a batch and before an
idle drafter takes its next batch, as the real verifier drains its command queue before
scheduling and the real batcher lets the verdicts that came together in.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from bench.sim.edge_cpu import SharedCores
from bench.sim.result import Recorder, RequestRecord, SimResult, summarise
from bench.sim.spec import DrafterSpec, SimSpec
from bench.sim.state import Edge, Events, Kind, Lookahead, Session, Step, Verdict
from bench.sim.tokens import acceptance_prob, features
from bench.sim.verifier import SimVerifier
from services.coordinator.share import EvenShare
from services.drafter.control import ControlSettings, StepDecision, make_controller
from services.drafter.control.predicted_rejection import RejectionStopController
from services.verifier.allocation import draft_share
from services.verifier.batching import slo_met


def _edge(index: int, d: DrafterSpec, threshold: float) -> Edge:
    return Edge(index, d.name, d.alpha, d.token_s, d.round_s, d.prefill_token_s, d.send_s, d.rtt_s / 2, d.max_batch,
                d.pipeline_sessions, d.lookahead_token_s, d.proposal_rate, ControlSettings(threshold), d.forward_s,
                d.conditional, d.jitter_s, d.draft_spread, d.send_spread, d.send_rows)


class Simulation:
    """One run of a spec. Use :func:`simulate`; the object is single-use."""

    def __init__(self, spec: SimSpec) -> None:
        self.spec, self.now = spec, 0.0
        self.events = Events()
        self.rng = random.Random(spec.seed)
        self.rec = Recorder(len(spec.drafters))
        self.verifier = SimVerifier(spec, spec.cost.build(), self.events, self.rec, lambda: self.now, self.rng)
        self.edges = [_edge(i, d, spec.policies.threshold) for i, d in enumerate(spec.drafters)]
        self.ready: list[Edge] = []  # drafters that may start a batch at the end of this instant
        self.target_rounds = spec.rounds * len(spec.drafters) if spec.rounds is not None else None
        pool = spec.shared_requests
        for edge, d in zip(self.edges, spec.drafters, strict=True):
            closed = min(d.concurrency, d.requests) if d.requests else d.concurrency
            if spec.shared_requests:
                closed = min(d.concurrency, pool)
                pool -= closed
            starts = sorted(d.arrivals) if d.arrivals else _first_starts(d.starts, closed)
            edge.scheduled = len(starts)
            for at in starts:
                self.events.push(at, Kind.ARRIVE, edge)
        self.started = spec.shared_requests - pool  # requests started from the shared pool
        self.drafted = EvenShare()  # new requests routed to drafters (``auto``), as the coordinator does
        self.cores = SharedCores(spec.edge_cores, spec.edge_background, self.events) if spec.edge_cores else None
        self.handlers: dict[Kind, Callable[[Any], None]] = {
            Kind.ARRIVE: self._arrive_due, Kind.OPEN: self._open, Kind.VERDICT: self._verdict,
            Kind.DRAFT_DONE: self._draft_done, Kind.DRAFT_IN: self._draft_in, Kind.STEP_END: self._step_end,
            Kind.LOOKAHEAD_STEP: self._lookahead_step, Kind.WAKE: lambda _: None,
            Kind.CONDITIONAL_IN: self._conditional_in, Kind.EDGE_CPU: self._edge_cpu}

    # --- the loop ----------------------------------------------------------------------------

    def run(self, progress: bool = False) -> SimResult:
        wall = time.perf_counter()
        bar = _Progress(self, progress)
        handlers = self.handlers
        while self.events and not self._done():
            at = self.events.next_time()
            assert at is not None
            if self.spec.duration_s is not None and at > self.spec.duration_s:
                self.now = self.spec.duration_s
                break
            self.now = at
            while self.events.next_time() == at:
                _, kind, payload = self.events.pop()
                handlers[kind](payload)
                bar.tick()
            self._start_batches()
            self.verifier.try_start(self.now)
        bar.close()
        return self._result(time.perf_counter() - wall)

    def _compute(self, seconds: float, kind: Kind, payload: Any) -> None:
        """A drafter computes for ``seconds`` (CPU seconds on shared cores, if any), then ``kind``."""
        if self.cores is None:
            self.events.push(self.now + seconds, kind, payload)
        else:
            self.cores.start(self.now, seconds, kind, payload)

    def _edge_cpu(self, version: int) -> None:
        assert self.cores is not None
        for kind, payload in self.cores.finish(version, self.now):
            self.handlers[kind](payload)

    def _done(self) -> bool:
        return self.target_rounds is not None and self.rec.rounds >= self.target_rounds

    def label(self) -> str:
        p, n = self.spec.policies, len(self.spec.drafters)
        policies = f"{p.allocation}/{p.batching}/{p.controller}" if self.spec.speculative else "target-only"
        return f"{self.spec.cost.kind} N={n} {policies}"

    def _result(self, wall_s: float) -> SimResult:
        p = self.spec.policies
        return summarise(self.rec, self.now, self.verifier.tracker.sum_log_x(), wall_s, label=self.label(),
                         n_drafters=len(self.edges), cost=self.spec.cost.kind, allocation=p.allocation,
                         batching=p.batching, controller=p.controller, speculative=self.spec.speculative)

    # --- requests ----------------------------------------------------------------------------

    def _arrive_due(self, edge: Edge) -> None:
        edge.scheduled -= 1
        self._arrive(edge)

    def _arrive(self, edge: Edge) -> None:
        d = self.spec.drafters[edge.index]
        speculative = self._to_drafter()
        controller = make_controller(self.spec.policies.controller, edge.settings) if speculative else None
        s = Session(f"{edge.name}-r{edge.requests}", edge, d.prompt_len, d.max_tokens, d.slo_tokens_per_s, self.now,
                    controller, speculative)
        edge.requests += 1
        edge.live += 1
        self.events.push(self.now + edge.half_rtt, Kind.OPEN, s)

    def _to_drafter(self) -> bool:
        """The coordinator's choice for a new request (``Generator.to_drafter``)."""
        if not self.spec.speculative or not self.spec.auto:
            return self.spec.speculative
        return self.drafted.take(draft_share(self.verifier.allocator, self.verifier.tracker))

    def _open(self, s: Session) -> None:
        self.verifier.admit(s, self.now)

    def _complete(self, s: Session) -> None:
        """Its last tokens reached the client: record it; in a closed loop, start the next request."""
        first = s.first_token_at if s.first_token_at is not None else self.now
        tpot = (self.now - first) / (s.generated - 1) if s.generated > 1 else None
        self.rec.requests.append(RequestRecord(s.edge.index, self.now - s.arrived_at, first - s.arrived_at, tpot,
                                               s.slo, slo_met(s.arrived_at, s.generated, s.slo, self.now),
                                               s.speculative))
        s.edge.live -= 1
        d = self.spec.drafters[s.edge.index]
        if self.spec.shared_requests:
            if self.started < self.spec.shared_requests:
                self.started += 1
                self._arrive(s.edge)
        elif not d.arrivals and (not d.requests or s.edge.requests + s.edge.scheduled < d.requests):
            self._arrive(s.edge)

    # --- drafters ----------------------------------------------------------------------------

    def _verdict(self, v: Verdict) -> None:
        s = v.session
        s.drafter_round = v.round + 1
        if s in s.edge.in_flight:
            s.edge.in_flight.remove(s)
        if v.drafted > 0 and s.controller is not None:
            s.controller.end_round(v.drafted, min(v.accepted, v.drafted), s.draft_s, self.now - s.sent_at)
            if isinstance(s.controller, RejectionStopController):
                s.controller.shared.wait_trained()  # a retraining runs to completion: deterministic
        if v.finished or v.budget <= 0:
            s.awaiting = False  # no next drafted round follows this verdict at once
        ahead = s.ahead
        if ahead is not None and (v.finished or v.budget <= 0 or not ahead.hit):
            self._drop(s)
        if v.finished:
            if s in s.edge.queue:  # the fill finished it while it waited for its draft model
                s.edge.queue.remove(s)
            self._complete(s)
        elif ahead is not None and s.ahead is ahead:  # it came true
            self._next_round(s)
            if ahead.sent:
                self._presented(s, ahead, v.budget)
                return
            ahead.wanted = True
            if not ahead.left:
                self._take(s)
        elif v.budget > 0:
            s.edge.queue.append(s)
            self.ready.append(s.edge)

    def _start_batches(self) -> None:
        """Idle drafters with ready sessions start a batch, once every event of the instant is in
        (as the real batcher lets the verdicts that arrived together in before it takes a batch);
        with none ready, they draft a token of each running lookahead."""
        for edge in self.ready:
            if not edge.busy and edge.queue:
                self._start_batch(edge)
            elif not edge.busy and edge.looking:
                self._start_lookahead_step(edge)
        self.ready.clear()

    # --- pipelined drafting ------------------------------------------------------------------

    def _look_ahead(self, s: Session, drafts: list[tuple[float, bool]], asked: int) -> None:
        """``s`` just sent ``drafts`` (its round asked for ``asked``): while its drafter serves few
        enough sessions, it drafts the next round ahead, which comes true when every draft is
        accepted (and no fill left them) and the first lookahead token guesses the verifier's bonus
        token (the drafter's α)."""
        edge = s.edge
        if not drafts or not 0 < edge.live <= edge.pipeline_sessions:
            return
        whole = all(ok for _, ok in drafts) and s.fill_broke != s.drafter_round
        # it asks as many as this round did, not only those it drafted
        s.ahead = Lookahead(whole and self.rng.random() < edge.alpha, asked, asked + 1, s.drafter_round)
        edge.looking.append(s)
        self.rec.lookaheads += 1

    def _start_lookahead_step(self, edge: Edge) -> None:
        batch = edge.looking[: edge.max_batch]
        edge.busy = True
        n = len(batch)  # one token of each: measured per lookahead, or one forward over n rows
        seconds = edge.lookahead_token_s * n if edge.lookahead_token_s else edge.forward_s + edge.token_s * n
        self._compute(seconds, Kind.LOOKAHEAD_STEP, (edge, tuple((s, s.ahead) for s in batch if s.ahead is not None)))

    def _lookahead_step(self, done: tuple[Edge, tuple[tuple[Session, Lookahead], ...]]) -> None:
        edge, batch = done
        edge.busy = False
        self.ready.append(edge)
        for s, ahead in batch:
            if s.ahead is not ahead:  # dropped meanwhile
                continue
            ahead.left -= 1
            if not ahead.left:
                edge.looking.remove(s)
                if ahead.wanted:
                    self._take(s)
                elif edge.conditional:
                    self._presend(s, ahead)

    def _presend(self, s: Session, ahead: Lookahead) -> None:
        """``s``'s lookahead is done before its verdict came: it leaves after the hand-off as the next
        round's conditional draft: its drafts drawn now, cut where the controller would stop them, as
        the real drafter does (``DraftController.keeps``, which changes no state)."""
        drafts = self._propose(s, ahead.tokens, screen=False)[0]
        ctl = s.controller
        if ctl is not None and ctl.wants_features:
            drafts = drafts[:ctl.keeps([features(a, i, len(drafts)) for i, (a, _) in enumerate(drafts)], len(drafts))]
        ahead.drafts = drafts
        if not ahead.drafts:  # its proposer had nothing past the guess: nothing to send (nor when it comes true)
            return
        ahead.sent = True
        self.rec.conditional_sent += 1
        self.events.push(s.edge.carry(self.now + s.edge.send_after(self.rng), True, self.rng), Kind.CONDITIONAL_IN,
                         (s, ahead))

    def _presented(self, s: Session, ahead: Lookahead, budget: int) -> None:
        """The verdict made ``s``'s conditional draft true: the verifier verifies it without it
        (``Lookahead.presented`` in the real drafter), which starts the round, asks its controller
        for a length as for any round (and ignores it), shows it the drafts the verifier holds (so
        that it learns from their verdict), and looks ahead past that draft."""
        s.ahead = None
        self.rec.lookaheads_used += 1
        asked = self._round_len(s, ahead.tokens, budget)
        if s.controller is not None and s.controller.wants_features:
            for i, (a, _) in enumerate(ahead.draft(budget)):
                s.controller.on_step(features(a, i, budget))
        s.draft_s = 0.0
        s.sent_at, s.awaiting = self.now, True
        s.edge.in_flight.append(s)
        self._look_ahead(s, ahead.draft(budget), asked)
        self.ready.append(s.edge)

    def _drop(self, s: Session) -> None:
        if s.ahead is not None and s in s.edge.looking:
            s.edge.looking.remove(s)
        s.ahead = None

    def _take(self, s: Session) -> None:
        """The verdict came true for ``s``'s lookahead: its next draft leaves after the hand-off (the
        controller screens it as a fresh one; the model's work is done)."""
        assert s.ahead is not None
        ahead, s.ahead = s.ahead, None
        k = self._round_len(s, ahead.tokens, s.budget)
        if ahead.drafts is not None:  # drawn when it was done (its proposer had nothing past the guess)
            s.drafts, s.asked = ahead.drafts[:k], k
        else:
            self._draw(s, k)  # the proposer may run out here, once
        self.rec.lookaheads_used += 1
        s.draft_s = 0.0
        self._send(s, s.edge.send_after(self.rng))

    def _start_batch(self, edge: Edge) -> None:
        """Draft every ready session of ``edge`` (up to its ``max_batch``) as one batch."""
        batch = [edge.queue.popleft() for _ in range(min(len(edge.queue), edge.max_batch))]
        self.rec.draft_batch(edge.index, len(batch))
        for s in batch:
            self._next_round(s)
        drafts = [self._draft(edge, s, len(batch)) for s in batch]
        # the batch runs one forward per draft position while any of its sessions still drafts
        seconds = (sum(t for t, _ in drafts) + edge.forward_s * max(n for _, n in drafts)) * edge.batch_factor(self.rng)
        edge.busy = True
        self._compute(seconds, Kind.DRAFT_DONE, (edge, tuple(batch), self.now))

    def _next_round(self, s: Session) -> None:
        """The drafter starts on ``s``'s next round: after the verdict on a draft it sent (an empty one
        too, as the real drafter's verify_wait counts), it records the wait since that draft left;
        not after the admission or a round the verifier ran target-only (budget 0)."""
        if s.awaiting:
            self.rec.verdict_wait(s.edge.index, self.now - s.sent_at)
            s.awaiting = False

    def _round_len(self, s: Session, cap: int, budget: int) -> int:
        """The draft length the controller picks within the round's ``budget``, ``cap`` and what the
        request can still use (at most ``max_tokens − generated − 1``)."""
        useful = max(0, min(budget, cap, self.spec.policies.max_draft_tokens, s.remaining - 1))
        return max(0, min(useful, s.controller.begin_round(useful))) if s.controller is not None else 0

    def _draft(self, edge: Edge, s: Session, rows: int) -> tuple[float, int]:
        """Draw ``s``'s draft for this round in a batch of ``rows`` sessions; returns its share of the
        batch's draft-model time (beyond the forwards' fixed cost) and the tokens it computed."""
        computed = self._draw(s, self._round_len(s, s.budget, s.budget), rows)
        if not computed:
            return 0.0, 0
        seconds = edge.round_s + edge.token_s * computed
        if not s.prefilled:
            seconds += edge.prefill_token_s * s.prompt_len
            s.prefilled = True
        return seconds, computed

    def _draw(self, s: Session, k: int, rows: int = 1) -> int:
        """Draft up to ``k`` synthetic tokens into ``s.drafts``; returns how many were computed."""
        s.drafts, computed = self._propose(s, k, rows=rows)
        s.asked = k
        return computed

    def _propose(self, s: Session, k: int, screen: bool = True, rows: int = 1) -> tuple[list[tuple[float, bool]], int]:
        """Up to ``k`` synthetic drafts of ``s``'s drafter, (accept prob, accepted) each, screened by
        ``s``'s controller unless not ``screen`` (a conditional draft), and how many were computed.
        Its features say that each step drafted for ``rows`` sessions: the batch's, while in the real
        drafter a step drafts for the sessions still drafting at that position."""
        ctl = s.controller if screen else None
        kappa, alpha, rate = self.spec.alpha_concentration, s.edge.alpha, s.edge.proposal_rate
        watch = ctl is not None and ctl.wants_features
        drafts: list[tuple[float, bool]] = []
        for i in range(k):
            if rate < 1.0 and self.rng.random() >= rate:  # the proposer has nothing more to propose
                return drafts, i
            a = acceptance_prob(self.rng, alpha, kappa)
            ok = self.rng.random() < a
            decision = ctl.on_step(features(a, i, k, rows)) if watch and ctl is not None else StepDecision.CONTINUE
            if decision is StepDecision.DISCARD:
                return drafts, i + 1
            drafts.append((a, ok))
            if decision is StepDecision.STOP:
                return drafts, i + 1
        return drafts, k

    def _draft_done(self, done: tuple[Edge, tuple[Session, ...], float]) -> None:
        edge, batch, began = done
        edge.busy = False
        for i, s in enumerate(batch):
            s.draft_s = self.now - began
            self._send(s, edge.batch_send_after(i, self.rng))

    def _send(self, s: Session, after: float = 0.0) -> None:
        """The draft leaves ``after`` seconds from now (not once its request finished: by a fill)."""
        if s.finished:
            return
        s.sent_at, s.awaiting = self.now + after, True
        s.edge.in_flight.append(s)
        self._look_ahead(s, s.drafts, s.asked)
        self.ready.append(s.edge)
        self.events.push(s.edge.carry(s.sent_at, True, self.rng), Kind.DRAFT_IN, s)

    def _conditional_in(self, sent: tuple[Session, Lookahead]) -> None:
        self.verifier.take_conditional(sent[0], sent[1], self.now)

    def _draft_in(self, s: Session) -> None:
        self.verifier.take_draft(s, self.now)

    def _step_end(self, step: Step) -> None:
        self.verifier.end_step(step, self.now)


def _first_starts(starts: tuple[float, ...], n: int) -> list[float]:
    """When a closed loop's ``n`` first requests start: ``starts`` in order, the last of them for any
    beyond (all at 0 without any)."""
    ordered = sorted(starts)[:n]
    return ordered + [ordered[-1] if ordered else 0.0] * (n - len(ordered))


class _Progress:
    """A tqdm bar of verified rounds (and admissions: a burst of them can take long with an O(N)
    allocator), redrawn at most twice a second."""

    def __init__(self, sim: Simulation, enabled: bool) -> None:
        self.sim, self.enabled, self.last = sim, enabled, 0.0
        self.bar = tqdm(total=sim.target_rounds, disable=not enabled, unit="round", desc=sim.label(), leave=False)

    def tick(self) -> None:
        if not self.enabled or time.perf_counter() - self.last < 0.5:
            return
        self.last = time.perf_counter()
        self.bar.n = self.sim.rec.rounds
        self.bar.set_postfix_str(f"t={self.sim.now:.2f}s admitted={len(self.sim.rec.admit_s)}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def simulate(spec: SimSpec, progress: bool = False) -> SimResult:
    """Run ``spec`` to its bound. Deterministic for the spec (and its seed) except the wall-clock
    fields of the result (``result.WALL_CLOCK_FIELDS``); ``progress`` shows a tqdm bar."""
    return Simulation(spec).run(progress)


__all__ = ["Simulation", "simulate"]
