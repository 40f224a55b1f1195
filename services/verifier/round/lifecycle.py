"""A round in the torch engine core, from its draft to its verdict.

    draft      the round's draft taken (or a conditional one held, or dropped as out of turn)
    close      after the forward: the fill's tokens committed and streamed; each verified round
               judged, its KV rolled back past the rejected drafts, its tokens committed up to a
               stop, the budgets of the next rounds assigned, its verdict published, the next
               round begun (with the conditional draft that came true, if one did)
    fail       a round the step could not run: its request ends with an error

Results go to the core's outbox; finished requests go back to the request table.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.verifier.allocation import RoundStats
from services.verifier.core_api import AddDraft, Committed, Ending, Filled, OutOfTurn, Result, Rounded
from services.verifier.fill import Fill
from services.verifier.judge import Judgement, races
from services.verifier.metrics import VerifierMetrics
from services.verifier.requests import Request, Status
from services.verifier.round.budgets import DraftBudgets
from services.verifier.scheduler import Step
from services.verifier.trim import TrimPolicy
from shared.protocol import TokenLogprob


class RoundLifecycle:
    def __init__(self, budgets: DraftBudgets, trim: TrimPolicy, fill: Fill, metrics: VerifierMetrics,
                 results: list[Result], retire: Callable[[Request], None], *, recompute_context: bool = False) -> None:
        self.budgets, self.trim, self.fill, self.metrics = budgets, trim, fill, metrics
        self.results, self.retire = results, retire
        self.recompute_context = recompute_context  # SLED-like baseline: no KV kept across rounds

    # --- drafts ------------------------------------------------------------------------------

    def draft(self, req: Request | None, cmd: AddDraft) -> None:
        if cmd.after is not None:
            self._conditional(req, cmd)
        elif req is None or req.status is not Status.WAITING_DRAFT or cmd.round != req.round.number:
            where = f"round {req.round.number}" if req is not None else "no open session"
            self.results.append(OutOfTurn(cmd.request_id, f"session {cmd.request_id} expects {where}, "
                                                          f"got a draft for round {cmd.round}"))
        else:
            self._take(req, cmd)

    def _conditional(self, req: Request | None, cmd: AddDraft) -> None:
        """A draft sent before the Verdict it assumes (``round.conditional``)."""
        if req is None or req.status is Status.FINISHED or cmd.after is None:
            return
        r = req.round
        placed = r.upcoming.place(cmd.round, r.number, cmd.after, r.last_tokens, cmd, holds=True,
                                  takes=req.status is Status.WAITING_DRAFT)
        if placed == "taken":
            self._take(req, cmd)
        if placed != "held":
            self.metrics.conditional.labels(placed).inc()

    def _take(self, req: Request, cmd: AddDraft) -> None:
        """The draft of the round the session waits for."""
        r = req.round
        r.pause_left = cmd.asks.pause_rounds
        guess = (cmd.asks.guess_bonus and not req.greedy and req.sampler.race_key is None  # shared.coupling
                 and req.params.seed is None)
        wait = max(0.0, cmd.received_at - r.waiting_since)
        self.metrics.draft_wait.observe(wait)
        if cmd.after is None:  # a conditional one was there before the round: it says nothing of the wait
            self.metrics.observe_fill_wait(req.drafter, wait, self.fill.observe(req.drafter, wait))
        r.take(cmd.token_ids, cmd.q, cmd.confidence, wait_s=wait, guess_bonus=guess, drafting_s=cmd.drafting_s,
               ahead=cmd.ahead)
        req.mark_ready()

    # --- after the forward -------------------------------------------------------------------

    def close(self, step: Step, verdicts: list[Judgement]) -> None:
        """The step's judged rounds (verified ones first, then the fill's) committed and published."""
        verdicts, filled = verdicts[: len(step.verify)], verdicts[len(step.verify) :]
        for req, v in zip(step.fill, filled, strict=True):
            self._fill(req, v)
        self.metrics.raced_bonus.inc(sum(races(req, drafts, v.accepted)
                                         for (req, drafts), v in zip(step.verify, verdicts, strict=True)))
        kept = [self._commit(req, drafts, v.accepted, v.tokens) for (req, drafts), v in
                zip(step.verify, verdicts, strict=True)]
        budgets = self._next_budgets(step, verdicts)
        for (req, drafts), v, k in zip(step.verify, verdicts, kept, strict=True):
            logprobs = v.logprobs[: len(k)] if v.logprobs is not None else None
            drafted, accepted, _ = req.round.outcome(len(drafts), v.accepted, v.accept_prob)
            self._publish(req, drafted, accepted, k, budgets.get(req.request_id, 0), logprobs)

    def fail(self, req: Request, error: str) -> None:
        req.finish("error")
        self.results.append(Rounded(req.request_id, req.round.number, 0, 0, Committed([]), 0, Ending("error", error)))
        self.retire(req)

    def _next_budgets(self, step: Step, verdicts: list[Judgement]) -> dict[str, int]:
        """Fold the speculating sessions' rounds into the estimates; their next budgets."""
        rounds = [_round_stats(req, len(d), v) for (req, d), v in zip(step.verify, verdicts, strict=True)
                  if req.speculative and req.status is not Status.FINISHED]
        for r in rounds:
            self.metrics.count_drafter(r.drafter or "", r.drafted, r.accepted)
        budgets = self.budgets.next(rounds)
        self.metrics.allocation_time.observe(self.budgets.assign_s)
        for req, _ in step.verify:  # rounds the drafter asked to run without it: budget 0
            if req.round.pause_left > 0 and req.request_id in budgets:
                budgets[req.request_id] = self.budgets.hold(req.request_id, 0)
                req.round.pause_left -= 1
        if rounds:
            self.metrics.observe_allocation(self.budgets.tracker)
        return budgets

    def _commit(self, req: Request, drafts: list[int], accepted: int, tokens: list[int]) -> list[int]:
        """Roll the KV back past rejected drafts and commit the round's tokens; returns those kept."""
        assert req.slot is not None
        keep = 0 if self.recompute_context else req.slot.length - (len(drafts) - accepted)
        req.slot.truncate(keep)  # keep the accepted drafts' keys/values (none: the next round recomputes all)
        self.trim.observe_round(req.drafter, req.round.draft.confidence, len(drafts), accepted)  # its calibration
        return req.commit(tokens)

    def _fill(self, req: Request, v: Judgement) -> None:
        """A token decoded while the session's draft travels: committed now and streamed to the
        client; its drafter hears of it with the round's Verdict (``Rounded.prior``)."""
        kept = self._commit(req, [], 0, v.tokens)
        logprobs = v.logprobs[: len(kept)] if v.logprobs is not None else None
        self.metrics.filled.inc(len(kept))
        if req.status is Status.FINISHED:  # the round ends here: the drafter's draft for it is moot
            self._publish(req, 0, 0, kept, 0, logprobs)  # counts the tokens generated
            return
        self.metrics.count_generated(len(kept))
        self.results.append(Filled(req.request_id, req.round.number, kept, list(req.round.fill), logprobs))
        req.round.fill.extend(kept)

    def _publish(self, req: Request, drafted: int, accepted: int, kept: list[int], budget: int,
                 logprobs: list[TokenLogprob] | None = None) -> None:
        finished, r = req.status is Status.FINISHED, req.round
        budget = 0 if finished or not req.speculative else min(budget, self.budgets.cap)
        committed = Committed(kept, list(r.fill), logprobs)
        self.results.append(Rounded(req.request_id, r.number, drafted, accepted, committed, budget,
                                    Ending(req.finish_reason) if finished else None))
        self.metrics.count_round(drafted, accepted, len(kept))
        if finished:
            self.retire(req)
            return
        if req.speculative:
            self.metrics.count_budget(budget, r.budget)
        r.budget = budget
        req.next_round((*r.fill, *kept))
        upcoming, held = r.upcoming.came_true(r.last_tokens)
        if req.status is not Status.WAITING_DRAFT:  # the round runs without a draft (budget 0, or no drafter)
            upcoming = None
        dropped = held - (upcoming is not None)
        if dropped:
            self.metrics.conditional.labels("dropped").inc(dropped)
        if upcoming is not None:
            self._take(req, upcoming)
            self.metrics.conditional.labels("taken").inc()


def _round_stats(req: Request, verified: int, v: Judgement) -> RoundStats:
    """What the allocator learns from a verified round (the fill's matches included)."""
    drafted, accepted, accept_prob = req.round.outcome(verified, v.accepted, v.accept_prob)
    verify_s = time.perf_counter() - req.ready_since if req.ready_since > 0 else None
    return RoundStats(req.request_id, req.drafter or None, drafted, accepted, len(req.committed), accept_prob,
                      req.round.draft.wait_s, req.round.draft.drafting_s, req.round.draft.ahead, verify_s)
