"""What the next forward step runs: verification rounds first, then prefill chunks.

Each step has a token budget (``max_tokens``) and a session budget (``max_sessions``):

1. **Verify.** Sessions that are READY (their draft arrived, or they decode target-only) and
   whose prompt is cached, or whose uncached rest fits in one chunk, are offered to the batch
   policy (FCFS, WISP, ...). Each feeds its uncached committed tokens (at least the last
   one) plus its drafts, and gets logits from its last committed token on. The trim policy
   may then drop tail drafts of the chosen sessions that carry confidences (``trim``).
2. **Fill.** A step with nothing to verify may decode, target-only, deterministic (greedy or raced)
   sessions whose drafts are on their way: one token each, which verifying their drafts would
   have committed anyway (``requests``), as many as end before the next draft is expected
   (``fill``). So a slow link does not leave the target idle, and filling takes no step from a
   verification.
3. **Prefill.** Sessions with more of the prompt to cache get chunks, oldest first, with no
   logits at all. While verification runs in the step, prefill takes at most ``prefill_chunk``
   tokens, so a long prompt is cached in pieces between rounds and running sessions keep
   streaming; a step with nothing to verify prefills up to the whole token budget.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.verifier.allocation.base import expected_tokens
from services.verifier.allocation.tracker import GoodputTracker
from services.verifier.batching import BatchLimits, BatchPolicy, Candidate, SloClock
from services.verifier.batching.estimator import SegmentShape, StepTimeEstimator
from services.verifier.fill import Fill, FillBeforeDrafts, W
from services.verifier.requests import Request, Status
from services.verifier.trim import TrimItem, TrimPolicy, make_trim
from shared.runner import Segment


@dataclass
class Step:
    verify: list[tuple[Request, list[int]]] = field(default_factory=list)  # (request, drafts)
    fill: list[Request] = field(default_factory=list)  # decoded one token while their drafts travel
    prefill: list[Request] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)  # verify segments first, then fill, then prefill
    shapes: list[SegmentShape] = field(default_factory=list)  # one per segment, for the step-time estimator
    prefill_tokens: int = 0
    verify_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.segments)


def choose_riders(fill: Fill, batcher: BatchPolicy, limits: BatchLimits, waiting: Sequence[W], sessions: int,
                  tokens: int) -> list[W]:
    """The riders of a step that verifies ``sessions`` sessions of ``tokens`` tokens: the waiting sessions
    the fill policy picks within the step's limits, as many of them as the batch policy's batch takes
    (WISP: within its deadline). The real scheduler's and the simulator's."""
    riders = fill.riders(waiting, min(limits.max_sessions - sessions, limits.max_tokens - tokens))
    return riders[: batcher.riders_fit([r.cached for r in riders])]


class Scheduler:
    def __init__(self, batcher: BatchPolicy, limits: BatchLimits, prefill_chunk: int,
                 estimator: StepTimeEstimator | None = None, trim: TrimPolicy | None = None,
                 tracker: GoodputTracker | None = None, fill: Fill | None = None) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.batcher = batcher
        self.limits = limits
        self.prefill_chunk = prefill_chunk
        self.estimator = estimator or StepTimeEstimator()
        self.trim = trim or make_trim("none")
        self.tracker = tracker  # α̂ per session, for the candidates' expected tokens
        self.fill = fill or FillBeforeDrafts()  # decode waiting sessions in otherwise idle time
        self.last_decision_s = 0.0
        self.last_trimmed = 0

    def verifiable(self, req: Request) -> bool:
        return req.status is Status.READY and req.to_prefill <= self.prefill_chunk

    def schedule(self, active: Iterable[Request], hold: set[int] | None = None) -> Step:
        """``hold``: ``id()`` of requests to leave out of this step (they wait for a shared prefix)."""
        active = [r for r in active if r.slot is not None and r.status is not Status.FINISHED
                  and (not hold or id(r) not in hold)]
        step = Step()
        self._add_verify(step, [r for r in active if self.verifiable(r)])
        if step.verify:
            self._add_riders(step, active)
        else:
            self._add_fill(step, active)
        chosen = {id(req) for req, _ in step.verify}
        self._add_prefill(step, [r for r in active if r.to_prefill > 0 and id(r) not in chosen])
        return step

    def _add_verify(self, step: Step, ready: list[Request]) -> None:
        if not ready:
            return
        started = time.perf_counter()
        drafts = {r.request_id: r.drafts_to_verify() for r in ready}
        by_id = {r.request_id: r for r in ready}
        chosen = [by_id[rid] for rid in self.batcher.select([self._candidate(r, drafts[r.request_id]) for r in ready],
                                                            self.limits)]
        keep = self._trim(chosen, drafts)
        self.last_decision_s = time.perf_counter() - started
        for req in chosen:
            d = drafts[req.request_id][: keep.get(req.request_id, len(drafts[req.request_id]))]
            assert req.slot is not None
            feed = req.committed[req.cached :]
            step.verify.append((req, d))
            step.segments.append(Segment(req.slot, [*feed, *d], len(feed) - 1))
            step.shapes.append(SegmentShape(new=len(feed) + len(d), cached=req.cached))
            step.verify_tokens += len(feed) + len(d)

    def fill_wait_s(self, requests: Iterable[Request]) -> float | None:
        """Seconds until a fill step may run (0: now), when no draft comes first; None: none will."""
        active = [r for r in requests if r.slot is not None and r.status is not Status.FINISHED]
        if not any(r.fillable for r in active):
            return None
        now = time.perf_counter()
        if self.fill.choose(active, self.estimator, now, 1):
            return 0.0
        return self.fill.next_change(active, now)

    def _add_fill(self, step: Step, active: list[Request]) -> None:
        """One target-only token for each waiting session the fill policy chooses."""
        limit = min(self.limits.max_sessions, self.limits.max_tokens)
        self._fill_rows(step, self.fill.choose(active, self.estimator, time.perf_counter(), limit))

    def _add_riders(self, step: Step, active: list[Request]) -> None:
        """In a step that verifies anyway: one target-only token for the waiting sessions that fit
        the step's limits and the batch policy's deadlines (without them, a session whose drafter is
        slow gets nothing until its draft comes)."""
        self._fill_rows(step, choose_riders(self.fill, self.batcher, self.limits, active, len(step.segments),
                                            step.verify_tokens))

    @staticmethod
    def _fill_rows(step: Step, reqs: list[Request]) -> None:
        for req in reqs:
            assert req.slot is not None
            step.fill.append(req)
            step.segments.append(Segment(req.slot, req.committed[req.cached :], 0))
            step.shapes.append(SegmentShape(new=1, cached=req.cached))
            step.verify_tokens += 1

    def _candidate(self, r: Request, drafts: list[int]) -> Candidate:
        est = self.tracker.sessions.get(r.request_id) if self.tracker is not None else None
        expected = expected_tokens(est.alpha, len(drafts)) if est is not None else 1.0
        return Candidate(r.request_id, r.to_prefill + 1 + len(drafts), len(r.committed), r.ready_since,
                         cached=r.cached, clock=SloClock(r.arrived_at, r.generated, r.slo_tokens_per_s),
                         expected_tokens=expected)

    def _trim(self, chosen: list[Request], drafts: dict[str, list[int]]) -> dict[str, int]:
        """Drafts to keep per session: the trim policy's choice where the drafts carry confidences."""
        items, fixed = [], []
        for req in chosen:
            d, conf = drafts[req.request_id], req.round.draft.confidence
            fed = len(req.committed) - req.cached
            if d and conf is not None and len(conf) >= len(d):
                items.append(TrimItem(req.request_id, req.cached, fed, conf[: len(d)], req.drafter))
            else:
                fixed.append(SegmentShape(new=fed + len(d), cached=req.cached))
        keep = self.trim.decide(items, self.estimator, fixed) if items else {}
        self.last_trimmed = sum(len(i.confidence) - keep.get(i.session_id, len(i.confidence)) for i in items)
        return keep

    def _add_prefill(self, step: Step, pending: list[Request]) -> None:
        budget = self.limits.max_tokens - step.verify_tokens
        if step.verify:
            budget = min(budget, self.prefill_chunk)
        for req in sorted(pending, key=lambda r: r.arrived_at):
            if budget <= 0 or len(step.segments) >= self.limits.max_sessions:
                break
            assert req.slot is not None
            n = min(req.to_prefill, budget)
            chunk = req.committed[req.cached : req.cached + n]
            step.prefill.append(req)
            step.segments.append(Segment(req.slot, chunk, n))
            step.shapes.append(SegmentShape(new=n, cached=req.cached))
            step.prefill_tokens += n
            budget -= n
