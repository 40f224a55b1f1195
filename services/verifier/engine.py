"""The verifier's busy loop: drain inputs -> select a batch -> verify it -> publish.

    while running:
        1. drain inputs      (open sessions, accept drafts, cancellations, lost drafters)
        2. select a batch    (BatchPolicy over the READY sessions)
        3. verify            (one batched forward pass + the acceptance math, off the event loop)
        4. publish           (Verdicts to drafters, TokenEvents to frontends, next budgets)

Only this task mutates sessions, so no locks are needed. Sessions whose drafter is gone, or
that were opened without one, are "autonomous": the target decodes them alone, batched the
same way (the centralized-serving baseline and the fallback that keeps requests alive).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from services.verifier.allocation import Allocator, RoundStats
from services.verifier.backends.base import ScoreItem, VerifierBackend
from services.verifier.batching import BatchLimits, BatchPolicy, Candidate
from services.verifier.intake import Intake
from services.verifier.sessions import Session, Status
from shared.acceptance import DraftError, dense_q, verify_greedy, verify_sampled
from shared.log import get_logger
from shared.protocol import FinishReason, Message, TokenEvent, Verdict
from shared.sampling import is_greedy, probs_from_logits

log = get_logger("verifier.engine")
#: finished request ids remembered, so a re-delivered request is answered "duplicate"
FINISHED_IDS_KEPT = 100_000


class Outbox(Protocol):
    """Where the engine's messages go (the server's connection registry)."""

    def to_conn(self, conn_id: str, msg: Message) -> None:
        """Send to one connection (a drafter, or the frontend that sent a frame)."""

    def to_frontend(self, origin: str, msg: Message) -> None:
        """Send to the frontend(s) registered under ``origin`` (dropped if none is connected)."""


@dataclass(frozen=True)
class Inbound:
    conn_id: str
    role: str  # "drafter" | "frontend" | "gone" (the drafter connection closed)
    msg: Message | None


@dataclass
class EngineStats:
    steps: int = 0
    verified_sessions: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0


class Engine:
    def __init__(
        self, backend: VerifierBackend, tokenizer: Any, eos_ids: set[int], outbox: Outbox,
        allocator: Allocator, batcher: BatchPolicy, limits: BatchLimits, max_sessions: int,
        max_draft_tokens: int, draft_timeout_s: float = 30.0,
    ) -> None:
        if limits.max_sessions < 1 or limits.max_tokens < 1:
            raise ValueError("batch limits must allow at least one session and one token")
        self.backend, self.outbox = backend, outbox
        self.allocator, self.batcher, self.limits = allocator, batcher, limits
        self.max_draft_tokens = max_draft_tokens
        self.draft_timeout_s = draft_timeout_s
        self.sessions: dict[str, Session] = {}
        self.finished_ids: OrderedDict[str, None] = OrderedDict()
        self.stats = EngineStats()
        self.inbox: asyncio.Queue[Inbound] = asyncio.Queue()
        self.intake = Intake(self, tokenizer, eos_ids, max_sessions)
        self._running = True

    # --- inputs (called by the server from any task) -----------------------------------

    def submit(self, conn_id: str, role: str, msg: Message | None) -> None:
        self.inbox.put_nowait(Inbound(conn_id, role, msg))

    def stop(self) -> None:
        self._running = False
        self.inbox.put_nowait(Inbound("", "wake", None))

    # --- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        log.info("engine started", allocation=self.allocator.name, batching=self.batcher.name)
        while self._running:
            await self._drain(block=not self._ready())
            self._expire_silent_drafters()
            ready = self._ready()
            if ready:
                await self._step(ready)

    def _ready(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.status is Status.READY]

    async def _drain(self, block: bool) -> None:
        if block:  # wake at least every second, so silent drafters are noticed
            try:
                await self.intake.handle(await asyncio.wait_for(self.inbox.get(), 1.0))
            except TimeoutError:
                return
        while not self.inbox.empty():
            await self.intake.handle(self.inbox.get_nowait())

    def _expire_silent_drafters(self) -> None:
        """A session whose drafter sent no draft for draft_timeout_s continues target-only."""
        now = time.monotonic()
        for s in self.sessions.values():
            if s.status is Status.WAITING_DRAFT and now - s.waiting_since > self.draft_timeout_s:
                log.warning("no draft in time; session continues target-only", request_id=s.request_id,
                            drafter=s.drafter, waited_s=round(now - s.waiting_since, 1))
                s.detach()

    async def _step(self, ready: list[Session]) -> None:
        cands = [Candidate(s.request_id, 1 + len(s.draft_tokens()), s.context_len, s.ready_since) for s in ready]
        chosen = [self.sessions[sid] for sid in self.batcher.select(cands, self.limits)]
        try:
            outcomes = await asyncio.to_thread(self._verify, chosen)
        except Exception as exc:  # the backend failed the whole pass: fail these sessions, keep serving
            log.exception("verification pass failed", sessions=len(chosen))
            for s in chosen:
                self.end(s, "error", error=f"verification failed: {exc}")
            return
        self.stats.steps += 1
        self.stats.verified_sessions += len(chosen)
        applied = []
        for s, outcome in zip(chosen, outcomes, strict=True):
            if isinstance(outcome, str):
                self.end(s, "error", error=outcome)
            else:
                applied.append(self._apply(s, *outcome))
        budgets = self.allocator.assign([r for r, _ in applied])
        for r, kept in applied:
            self._publish(r, kept, budgets.get(r.session_id, 0))

    # --- verification (runs in a worker thread) ------------------------------------------

    def _verify(self, batch: list[Session]) -> list[tuple[int, list[int]] | str]:
        """Per session: (drafts accepted, tokens to commit), or an error message for that session alone."""
        drafts = [s.draft_tokens() for s in batch]
        items = [ScoreItem(s.request_id, [s.last_token, *d]) for s, d in zip(batch, drafts, strict=True)]
        logits = self.backend.score(items)
        outcomes: list[tuple[int, list[int]] | str] = []
        for s, d, rows in zip(batch, drafts, logits, strict=True):
            try:
                n, extra = self._accept(s, d, rows)
                self.backend.commit(s.request_id, 1 + n)
                outcomes.append((n, [*d[:n], extra]))
            except Exception as exc:  # one bad session must not fail the others in its batch
                log.exception("acceptance failed", request_id=s.request_id)
                outcomes.append(f"acceptance failed: {exc}")
        return outcomes

    def _accept(self, s: Session, drafts: list[int], rows: torch.Tensor) -> tuple[int, int]:
        if is_greedy(s.params):
            return verify_greedy(drafts, rows.argmax(-1).tolist())
        p = probs_from_logits(rows, s.params)
        q = None
        if s.draft is not None and s.draft.q is not None:
            try:
                q = [dense_q(sq, tok, rows.shape[-1]) for sq, tok in zip(s.draft.q, drafts, strict=False)]
            except DraftError as exc:  # verifying as ids-only is still exactly lossless
                log.warning("draft q refused; verifying ids-only", request_id=s.request_id, reason=str(exc))
        return verify_sampled(drafts, p, q, s.gen)

    # --- after the pass ------------------------------------------------------------------

    def _apply(self, s: Session, accepted: int, tokens: list[int]) -> tuple[RoundStats, list[int]]:
        drafted = len(s.draft_tokens())
        s.drafted += drafted
        s.accepted += accepted
        kept = s.commit(tokens)
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.stats.generated += len(kept)
        return RoundStats(s.request_id, s.drafter, drafted, accepted, s.context_len), kept

    def _publish(self, r: RoundStats, kept: list[int], budget: int) -> None:
        s = self.sessions[r.session_id]
        finished = s.status is Status.FINISHED
        budget = min(budget, self.max_draft_tokens)
        self.emit_tokens(s, kept)
        peer = s.drafter if s.drafter is not None else (s.owner if finished else None)
        if peer is not None:
            self.outbox.to_conn(peer, Verdict(
                request_id=s.request_id, round=s.round, accepted=r.accepted, token_ids=kept,
                finished=finished, finish_reason=s.finish_reason, draft_budget=0 if finished else budget,
            ))
        s.round += 1
        s.draft_budget = budget
        s.draft = None
        if finished:
            self.retire(s)
        elif s.autonomous:
            s.mark_ready()
        else:
            s.wait_for_draft()

    def emit_tokens(self, s: Session, token_ids: list[int], error: str = "") -> None:
        """Send the frontend this round's tokens and the text they settle."""
        finished = s.status is Status.FINISHED
        self.outbox.to_frontend(s.origin, TokenEvent(
            request_id=s.request_id, origin=s.origin, token_ids=token_ids, text=s.text.release(finished),
            finished=finished, finish_reason=s.finish_reason, prompt_tokens=len(s.prompt_ids),
            completion_tokens=len(s.generated), drafted_tokens=s.drafted, accepted_tokens=s.accepted, error=error,
        ))

    def end(self, s: Session, reason: FinishReason, error: str = "") -> None:
        """Stop a session out of turn (cancelled or failed): tell both sides, free it."""
        s.finish(reason)
        self.emit_tokens(s, [], error=error)
        peer = s.drafter if s.drafter is not None else s.owner
        if peer is not None:
            self.outbox.to_conn(peer, Verdict(
                request_id=s.request_id, round=s.round, accepted=0, token_ids=[], finished=True,
                finish_reason=reason, draft_budget=0,
            ))
        self.retire(s)

    def retire(self, s: Session) -> None:
        """Forget a finished session: free its cache, remember its id against duplicates."""
        self.sessions.pop(s.request_id, None)
        self.backend.close(s.request_id)
        self.allocator.forget(s.request_id)
        self.finished_ids[s.request_id] = None
        while len(self.finished_ids) > FINISHED_IDS_KEPT:
            self.finished_ids.popitem(last=False)
        log.info("session finished", request_id=s.request_id, reason=s.finish_reason, tokens=len(s.generated),
                 rounds=s.round, drafted=s.drafted, accepted=s.accepted)
