"""What the next forward step runs: verification rounds first, then prefill chunks.

Each step has a token budget (``max_tokens``) and a session budget (``max_sessions``):

1. **Verify.** Sessions that are READY (their draft arrived, or they decode target-only) and
   whose prompt is cached, or whose uncached rest fits in one chunk, are offered to the batch
   policy (FCFS, WISP, ...). Each feeds its uncached committed tokens (at least the last
   one) plus its drafts, and gets logits from its last committed token on.
2. **Prefill.** Sessions with more of the prompt to cache get chunks, oldest first, with no
   logits at all. While verification runs in the step, prefill takes at most ``prefill_chunk``
   tokens, so a long prompt is cached in pieces between rounds and running sessions keep
   streaming; a step with nothing to verify prefills up to the whole token budget.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from services.verifier.batching import BatchLimits, BatchPolicy, Candidate
from services.verifier.requests import Request, Status
from shared.runner import Segment


@dataclass
class Step:
    verify: list[tuple[Request, list[int]]] = field(default_factory=list)  # (request, drafts)
    prefill: list[Request] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)  # verify segments first, then prefill
    prefill_tokens: int = 0
    verify_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.segments)


class Scheduler:
    def __init__(self, batcher: BatchPolicy, limits: BatchLimits, prefill_chunk: int) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.batcher = batcher
        self.limits = limits
        self.prefill_chunk = prefill_chunk

    def verifiable(self, req: Request) -> bool:
        return req.status is Status.READY and req.to_prefill <= self.prefill_chunk

    def schedule(self, active: Iterable[Request]) -> Step:
        active = [r for r in active if r.slot is not None and r.status is not Status.FINISHED]
        step = Step()
        self._add_verify(step, [r for r in active if self.verifiable(r)])
        chosen = {id(req) for req, _ in step.verify}
        self._add_prefill(step, [r for r in active if r.to_prefill > 0 and id(r) not in chosen])
        return step

    def _add_verify(self, step: Step, ready: list[Request]) -> None:
        if not ready:
            return
        drafts = {r.request_id: r.drafts_to_verify() for r in ready}
        by_id = {r.request_id: r for r in ready}
        cands = [Candidate(r.request_id, r.to_prefill + 1 + len(drafts[r.request_id]), len(r.committed), r.ready_since)
                 for r in ready]
        for rid in self.batcher.select(cands, self.limits):
            req, d = by_id[rid], drafts[rid]
            assert req.slot is not None
            feed = req.committed[req.cached :]
            step.verify.append((req, d))
            step.segments.append(Segment(req.slot, [*feed, *d], len(feed) - 1))
            step.verify_tokens += len(feed) + len(d)

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
            step.prefill_tokens += n
            budget -= n
