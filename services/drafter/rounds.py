"""One session's conversation with the verifier: open, draft/verdict rounds, finish.

Rounds of one session are strictly sequential (one outstanding Draft); many sessions run this
concurrently, each as its own asyncio task, sharing the link and the draft model: their draft
jobs go to the batcher, which drafts whichever sessions are ready together.

Outcomes, and what happens to the queue delivery:

* finished (any Verdict with ``finished``, including an unsolicited cancel): ack
* the verifier says ``duplicate``/``invalid`` or another error at open, or errors mid-session: ack
  (the verifier owns the request or already told the client)
* ``busy`` at open: wait and re-open; the delivery stays unacknowledged meanwhile
* the link drops (:class:`SessionAborted`): NOT acked; the loop releases it for re-delivery
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from services.drafter.batcher import DraftBatcher
from services.drafter.control.pipelining import PipelineGate
from services.drafter.link import LINK_LOST, Inbound, LinkDown, VerifierLink
from services.drafter.lookahead import BranchOdds, Presend
from services.drafter.metrics import DrafterMetrics
from services.drafter.proposers.base import EMPTY_PROPOSAL, Continuation, DraftJob, Proposal, Proposer
from services.drafter.sessions import DraftSession
from services.drafter.worker import ComputeWorker
from shared.log import get_logger
from shared.protocol import (
    MAX_CONDITIONAL_DRAFTS,
    MAX_DRAFT_TOKENS,
    CloseSession,
    Draft,
    ErrorFrame,
    OpenSession,
    SessionOpened,
    Verdict,
)

log = get_logger("drafter.rounds")

#: ErrorFrame codes at open after which the request is the verifier's business, not ours.
VERIFIER_OWNS = frozenset({"duplicate", "invalid", "orphaned"})  # declined opens that are no fault of ours
BUSY_RETRY_FIRST_S = 0.1
BUSY_RETRY_MAX_S = 2.0


#: Rounds a drafter asks the verifier to run without it when its controller chose to draft
#: nothing although it had a budget (``Draft.pause_rounds``): long enough to save the round
#: trips of rounds that would carry no draft, short enough to decide again soon.
PAUSE_ROUNDS = 8


@dataclass(frozen=True)
class RoundSettings:
    """How a drafter plays its rounds on one verifier connection (the drafter's flags of these
    names; ``max_draft_tokens`` and ``conditional`` as that verifier's Welcome allows)."""

    max_draft_tokens: int = MAX_DRAFT_TOKENS
    pipeline_sessions: int = 2  # draft the next round during verification while serving at most this many
    send_confidence: bool = False  # compute draft probabilities even without a controller that reads them
    lookahead_branches: int = 0  # alternative lookaheads per greedy round (lookahead.py)
    conditional: bool = False  # send each lookahead as a conditional Draft as soon as it is drafted


class SessionAborted(Exception):
    """The verifier link dropped under this session; leave its delivery unacknowledged."""


class SessionRunner:
    """Drives sessions against the verifier. Shared by all sessions of one connection."""

    def __init__(self, link: VerifierLink, proposer: Proposer, worker: ComputeWorker, batcher: DraftBatcher,
                 settings: RoundSettings, metrics: DrafterMetrics | None = None,
                 active: Callable[[], int] = lambda: 1) -> None:
        self.pipelining = PipelineGate(settings.pipeline_sessions)  # StarSD's gate on drafting ahead
        self.conditional = settings.conditional
        self.lookahead_branches = settings.lookahead_branches
        self.odds = BranchOdds()
        self.send_confidence = settings.send_confidence
        self.active = active  # how many sessions this drafter serves now
        self.link = link
        self.proposer = proposer
        self.worker = worker
        self.batcher = batcher
        self.max_draft_tokens = max(0, min(settings.max_draft_tokens, MAX_DRAFT_TOKENS))
        self.metrics = metrics or DrafterMetrics()

    async def run(self, session: DraftSession) -> bool:
        """Serve one session to its end. Returns True when its delivery should be acked.

        Raises SessionAborted when the link dropped (do not ack).
        """
        rid = session.request_id
        inbox = self.link.register(rid)
        try:
            opened = await self._open(session, inbox)
            if opened is None:
                return True
            self.worker.submit(self.proposer.start, rid, list(session.committed), session.params.max_tokens)
            session.budget = opened.draft_budget
            while session.finish_reason is None:
                await self._round(session, inbox)
            return True
        except LinkDown as exc:
            raise SessionAborted(str(exc)) from None
        finally:
            session.lookahead.cancel()
            self.link.unregister(rid)
            self.worker.submit(self.proposer.close, rid)

    # --- opening ---------------------------------------------------------------------------

    async def _open(self, session: DraftSession, inbox: asyncio.Queue[Inbound]) -> SessionOpened | None:
        req = session.delivery.request
        frame = OpenSession(request_id=req.request_id, prompt_ids=list(req.prompt_ids), params=req.params,
                            origin=req.origin, speculative=True, slo_tokens_per_s=req.slo_tokens_per_s)
        delay = BUSY_RETRY_FIRST_S
        while True:  # each attempt says how long the request has waited by now (busy retries included)
            await self.link.send(msgspec.structs.replace(frame, waited_s=max(0.0, time.time() - req.created_at)))
            reply = await self._reply_to_open(inbox)
            if isinstance(reply, SessionOpened):
                session.bonus_key, session.race_key = reply.bonus_key, reply.race_key
                if reply.committed_ids or reply.round:  # resumed: another drafter served it before us
                    session.committed.extend(reply.committed_ids)
                    session.round = reply.round
                    self.metrics.resumed.inc()
                log.info("session opened", request_id=req.request_id, draft_budget=reply.draft_budget,
                         resumed_at_token=len(reply.committed_ids), round=reply.round)
                return reply
            if isinstance(reply, Verdict):
                session.finish_reason = reply.finish_reason or "cancelled"
                log.info("request ended before it opened", request_id=req.request_id,
                         finish_reason=session.finish_reason)
                return None
            if reply.code == "busy":
                log.debug("verifier busy; retrying the open", request_id=req.request_id, retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, BUSY_RETRY_MAX_S)
                continue
            level = log.info if reply.code in VERIFIER_OWNS else log.warning
            level("verifier declined the session; dropping it", request_id=req.request_id, code=reply.code,
                  message=reply.message)
            session.finish_reason = reply.code
            return None

    async def _reply_to_open(self, inbox: asyncio.Queue[Inbound]) -> SessionOpened | Verdict | ErrorFrame:
        while True:
            msg = await _next(inbox)
            if isinstance(msg, SessionOpened | ErrorFrame):
                return msg
            if msg.finished:
                return msg
            # a non-final Verdict cannot belong to a session that is not open yet: stale, ignore

    # --- rounds ----------------------------------------------------------------------------

    async def _round(self, session: DraftSession, inbox: asyncio.Queue[Inbound]) -> None:
        rid = session.request_id
        if session.budget == 0:  # the verifier runs this round target-only, without waiting for us
            await self._target_round(session, inbox)
            return
        budget = session.useful_draft_len(min(session.budget, self.max_draft_tokens))
        k = max(0, min(budget, session.controller.begin_round(budget)))
        began = time.perf_counter()
        # a conditional Draft that came true is at the verifier already, cut to its budget there
        presented, guessed = session.lookahead.presented, session.lookahead.presented_guess
        ready = session.lookahead.take(session.budget if presented else k, session.controller)
        proposal, started, ended = (ready, began, began) if ready is not None else await self._draft(session, k)
        early = None if presented else _drain_final(inbox)  # cancelled while we drafted? then do not send a dead draft
        if early is not None:
            self._apply(session, early, drafted=0)
            return
        drafted = len(proposal.token_ids)
        # what the proposer was asked for: nothing once drafting failed; a draft from a lookahead, what that asked
        # within the round's length (a proposer that ran out drafted fewer: the shortfall counts as a fresh one's)
        asked = 0 if session.drafting_disabled else k if ready is None else \
            min(session.budget if presented else k, session.lookahead.asked)
        pause = PAUSE_ROUNDS if budget > 0 and k == 0 and not session.drafting_disabled else 0
        ahead = self._pipelines(session, proposal)
        # then the verifier races for its bonus token (a presented Draft said so when it was sent)
        guess = guessed if presented else ahead and not session.deterministic
        if not presented:
            await self.link.send(Draft(request_id=rid, round=session.round, token_ids=proposal.token_ids,
                                       q=proposal.q, confidence=_confidence(proposal), pause_rounds=pause,
                                       guess_bonus=guess, drafting_s=ended - started, ahead=ready is not None))
        sent = time.perf_counter()
        if ahead:
            self._look_ahead(session, proposal, k, guess)
        reply = await self._reply_to_draft(session, inbox)
        verdict_at = time.perf_counter()
        if isinstance(reply, Verdict):
            self._observe_capacity(verdict_at - sent, len(reply.token_ids))
            self.metrics.observe_round(started - began, ended - started, sent - ended, verdict_at - sent,
                                       asked=asked, drafted=drafted, accepted=min(reply.accepted, drafted),
                                       from_lookahead=ready is not None)
        if isinstance(reply, ErrorFrame):
            session.lookahead.cancel()
            await self._abandon(session, reply)
            return
        if reply.finished and reply.round != session.round:  # an unsolicited cancel
            session.lookahead.cancel()
            self._apply(session, reply, drafted=0)
            return
        if session.deterministic:  # runner-ups guess a deterministic verifier's token only
            self.odds.observe(proposal, reply, drafted)
        new = self._apply(session, reply, drafted)
        session.controller.end_round(drafted, min(reply.accepted, drafted), ended - started, verdict_at - sent)
        # settle first: it lets the lookahead that came true finish, so the commit finds all of its
        # rows in its cache and makes that cache the session's (draft_cache.SessionCaches.promote)
        await session.lookahead.settle(reply, drafted, self.metrics)
        if session.finish_reason is None:
            self.worker.submit(self.proposer.commit, rid, new, min(reply.accepted, drafted))

    async def _target_round(self, session: DraftSession, inbox: asyncio.Queue[Inbound]) -> None:
        """A round with budget 0: no draft is sent; the verifier decodes one token and sends the
        Verdict, whose budget says whether the next round is drafted again."""
        session.lookahead.cancel()  # it assumed drafts this round will not have
        reply = await self._reply_to_draft(session, inbox)
        if isinstance(reply, ErrorFrame):
            await self._abandon(session, reply)
            return
        new = self._apply(session, reply, drafted=0)
        if session.finish_reason is None:
            self.worker.submit(self.proposer.commit, session.request_id, new, 0)

    def _apply(self, session: DraftSession, verdict: Verdict, drafted: int) -> list[int]:
        """Record a round's Verdict on its session, and count what it committed (every token of
        the session's output passes here, whoever decoded it)."""
        new = session.apply_verdict(verdict, drafted)
        self.metrics.committed.inc(len(new))
        return new

    def _observe_capacity(self, return_s: float, committed: int) -> None:
        capacity = self.batcher.capacity
        capacity.observe_round(return_s, committed)
        if capacity.warm:
            self.metrics.n_full.set(capacity.n_full or 0)
            self.metrics.n_max.set(capacity.n_max or 0)

    def _pipelines(self, session: DraftSession, sent: Proposal) -> bool:
        """Whether the session drafts its next round while this one is verified (lookahead.py):
        greedy sessions, and unseeded sampled ones whose verifier couples its bonus token; and only
        while the draft model has time for it (StarSD's gate: ``control/pipelining.py``)."""
        coupled = (session.bonus_key is not None and session.params.seed is None and self.proposer.guesses_bonus)
        if not sent.token_ids or not (session.deterministic or coupled) or session.drafting_disabled:
            return False
        return self.pipelining.allows(self.active(), self.batcher.capacity)

    def _look_ahead(self, session: DraftSession, sent: Proposal, k: int, guess: bool) -> None:
        """Start the lookahead after ``sent``; with ``guess``, its first token runs the verifier's
        race of this round (shared.coupling)."""
        base = len(session.committed)
        race = (session.bonus_key, session.round) if guess and session.bonus_key is not None else None
        # no controller: a lookahead is not a round, and must not touch a controller's round state;
        # its features are kept so the controller screens it when the next round takes it
        job = DraftJob(session.drafting(), k + 1, after=Continuation(tuple(sent.token_ids), base, guess=race),
                       features=self._wants_features(session), spread=session.controller.wants_spread)
        # and for the likeliest rejections (a greedy draft's runner-ups; a sampled one has none), only
        # while this is the drafter's one session: with two, the extra rows took the draft model's slack
        # and lost more than they won (bench/RESULTS.md)
        alternatives = self.odds.pick(sent, self.lookahead_branches if self.active() <= 1 and session.deterministic
                                      else 0)
        # the verifier holds at most MAX_CONDITIONAL_DRAFTS; beyond, every branch waits for its verdict
        presend = self._presender(session) if 1 + len(alternatives) <= MAX_CONDITIONAL_DRAFTS else None
        session.lookahead.start(self.batcher, job, alternatives, presend, screen=session.controller)

    def _presender(self, session: DraftSession) -> Presend | None:
        """How a lookahead branch goes out as the next round's conditional Draft, before the verdict
        of the round in flight (lookahead.py); None when this verifier does not take them. The
        lookahead first cuts a branch where the session's controller would stop it (``DraftController.keeps``)."""
        if not self.conditional:
            return None
        rid, round_ = session.request_id, session.round

        async def presend(after: tuple[int, ...], draft: Proposal) -> bool:
            # whether round + 1 races its bonus token: decided now, as for any Draft, and kept by that round
            guess = self._pipelines(session, draft) and not session.deterministic
            with contextlib.suppress(LinkDown):  # the session sees the link drop in its inbox
                await self.link.send(Draft(request_id=rid, round=round_ + 1, token_ids=draft.token_ids, q=draft.q,
                                           confidence=_confidence(draft), guess_bonus=guess, after=list(after)))
            return guess
        return presend

    async def _draft(self, session: DraftSession, k: int) -> tuple[Proposal, float, float]:
        """The round's proposal, and when the worker started and ended computing it."""
        now = time.perf_counter()
        if k == 0 or session.drafting_disabled:
            return EMPTY_PROPOSAL, now, now
        try:
            proposal, started, ended = await self.batcher.propose(
                DraftJob(session.drafting(), k, controller=session.controller, features=self._wants_features(session)))
        except Exception as exc:  # a broken draft must not break the request: go target-only
            session.drafting_disabled = repr(exc)
            log.exception("drafting failed; the session continues with empty drafts",
                          request_id=session.request_id)
            return EMPTY_PROPOSAL, now, time.perf_counter()
        session.stats.draft_s += ended - started
        return proposal, started, ended

    def _wants_features(self, session: DraftSession) -> bool:
        return self.send_confidence or session.controller.wants_features

    async def _reply_to_draft(self, session: DraftSession, inbox: asyncio.Queue[Inbound]) -> Verdict | ErrorFrame:
        while True:
            msg = await _next(inbox)
            if isinstance(msg, ErrorFrame):
                return msg
            if isinstance(msg, Verdict) and (msg.round == session.round or msg.finished):
                return msg
            log.debug("ignored a stale frame", request_id=session.request_id, type=type(msg).__name__)

    async def _abandon(self, session: DraftSession, err: ErrorFrame) -> None:
        """The verifier refused a round: stop drafting for it and let the verifier finish it alone."""
        log.warning("verifier rejected a draft; handing the session back to the verifier",
                    request_id=session.request_id, code=err.code, message=err.message)
        session.finish_reason = "error"
        await self.link.send(CloseSession(request_id=session.request_id,
                                          reason=f"drafter stopped after verifier error {err.code}"))


async def _next(inbox: asyncio.Queue[Inbound]) -> SessionOpened | Verdict | ErrorFrame:
    msg = await inbox.get()
    if msg is LINK_LOST or not isinstance(msg, SessionOpened | Verdict | ErrorFrame):
        raise LinkDown("the verifier link dropped")
    return msg


def _drain_final(inbox: asyncio.Queue[Inbound]) -> Verdict | None:
    """A final Verdict that arrived while drafting, if any (it is consumed). Other frames stay
    queued, in order: a continuous verifier (vLLM) may end this round's Verdict before our
    draft even left, and the round then reads it from the inbox."""
    held: list[Inbound] = []
    final = None
    while not inbox.empty():
        msg = inbox.get_nowait()
        if msg is LINK_LOST:
            raise LinkDown("the verifier link dropped")
        if isinstance(msg, Verdict) and msg.finished and final is None:
            final = msg
        else:
            held.append(msg)
    for msg in held:
        inbox.put_nowait(msg)
    return final


def _confidence(proposal: Proposal) -> list[float] | None:
    """The draft model's probability of each drafted token, when the proposer computed them all."""
    if not proposal.token_ids or len(proposal.steps) != len(proposal.token_ids):
        return None
    return [min(1.0, max(0.0, step.token_prob)) for step in proposal.steps]
