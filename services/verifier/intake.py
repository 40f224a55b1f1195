"""Turning inbound frames into session state, with every check a peer's frame must pass.

Runs on the engine task (step 1 of its loop). A bad frame is answered with an ErrorFrame and
changes nothing; nothing a peer sends can raise out of here.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from services.verifier.backends.base import BackendError
from services.verifier.sessions import Session, Status
from shared.log import get_logger
from shared.protocol import Cancel, CloseSession, Draft, ErrorFrame, OpenSession, SessionOpened, TokenEvent
from shared.sampling import SamplingError, validate

if TYPE_CHECKING:
    from services.verifier.engine import Engine, Inbound

log = get_logger("verifier.intake")


class Intake:
    def __init__(self, engine: Engine, tokenizer: Any, eos_ids: set[int], max_sessions: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_sessions = max_sessions

    async def handle(self, item: Inbound) -> None:
        msg = item.msg
        if item.role == "gone":
            self._drafter_gone(item.conn_id)
        elif isinstance(msg, OpenSession):
            await self._open(item.conn_id, item.role, msg)
        elif isinstance(msg, Draft) and item.role == "drafter":
            self._draft(item.conn_id, msg)
        elif isinstance(msg, CloseSession) and item.role == "drafter":
            self._detach(item.conn_id, msg.request_id)
        elif isinstance(msg, Cancel) and item.role == "frontend":
            self._cancel(msg.request_id)
        elif msg is not None:
            self._error(item.conn_id, "unexpected", f"a {item.role} may not send {type(msg).__name__}", None)

    # --- opening -----------------------------------------------------------------------

    async def _open(self, conn_id: str, role: str, msg: OpenSession) -> None:
        eng = self.engine
        rid = msg.request_id
        if rid in eng.sessions or rid in eng.finished_ids:
            return self._error(conn_id, "duplicate", f"request {rid} is already served or finished", rid)
        if len(eng.sessions) >= self.max_sessions:
            return self._error(conn_id, "busy", f"verifier holds {self.max_sessions} sessions; retry", rid)
        problem = self._check_request(msg)
        if not problem:
            try:
                await asyncio.to_thread(eng.backend.open, rid, list(msg.prompt_ids))
            except (BackendError, RuntimeError) as exc:
                eng.backend.close(rid)
                log.exception("prefill failed", request_id=rid)
                problem = f"prefill failed: {exc}"
        if problem:  # the verifier owns the request now: tell its client, then the opener
            eng.outbox.to_frontend(msg.origin, TokenEvent(
                request_id=rid, origin=msg.origin, token_ids=[], text="", finished=True,
                finish_reason="error", prompt_tokens=len(msg.prompt_ids), error=problem))
            return self._error(conn_id, "invalid", problem, rid)
        drafter = conn_id if role == "drafter" and msg.speculative else None
        s = Session.create(rid, msg.origin, list(msg.prompt_ids), msg.params, drafter,
                           eng.backend.max_model_len, self.eos_ids, self.tokenizer)
        s.owner = conn_id if role == "drafter" else None  # told when it finishes, even if target-only
        s.draft_budget = min(eng.allocator.initial(rid), eng.max_draft_tokens) if drafter else 0
        eng.sessions[rid] = s
        if role == "drafter":
            eng.outbox.to_conn(conn_id, SessionOpened(request_id=rid, draft_budget=s.draft_budget))
        log.info("session opened", request_id=rid, prompt_len=len(msg.prompt_ids), drafter=drafter,
                 temperature=msg.params.temperature)
        return None

    def _check_request(self, msg: OpenSession) -> str:
        vocab = self.engine.backend.vocab_size
        if max(msg.prompt_ids) >= vocab:
            return f"prompt token id {max(msg.prompt_ids)} is outside the vocabulary of {vocab}"
        try:
            validate(msg.params, len(msg.prompt_ids), self.engine.backend.max_model_len)
        except SamplingError as exc:
            return str(exc)
        return ""

    # --- rounds ------------------------------------------------------------------------

    def _draft(self, conn_id: str, msg: Draft) -> None:
        s = self.engine.sessions.get(msg.request_id)
        rid = msg.request_id
        if s is None or s.drafter != conn_id:
            return self._error(conn_id, "unknown_session", f"no session {rid} for this drafter", rid)
        if s.status is not Status.WAITING_DRAFT or msg.round != s.round:
            return self._error(conn_id, "out_of_turn",
                               f"session {rid} expects round {s.round}, got a draft for round {msg.round}", rid)
        vocab = self.engine.backend.vocab_size
        if msg.token_ids and max(msg.token_ids) >= vocab:
            return self._error(conn_id, "invalid", f"draft token outside the vocabulary of {vocab}", rid)
        if msg.q is not None and len(msg.q) != len(msg.token_ids):
            return self._error(conn_id, "invalid",
                               f"draft has {len(msg.token_ids)} tokens but {len(msg.q)} q rows", rid)
        s.mark_ready(msg)
        return None

    def _detach(self, conn_id: str, request_id: str) -> None:
        s = self.engine.sessions.get(request_id)
        if s is not None and conn_id in (s.drafter, s.owner):
            s.detach()

    def _drafter_gone(self, conn_id: str) -> None:
        """The drafter's link closed: its sessions continue target-only, so no request is lost."""
        moved = [s for s in self.engine.sessions.values() if conn_id in (s.drafter, s.owner)]
        for s in moved:
            s.detach()
        if moved:
            log.warning("drafter gone; sessions continue target-only", conn=conn_id, sessions=len(moved))

    def _cancel(self, request_id: str) -> None:
        s = self.engine.sessions.get(request_id)
        if s is not None:
            self.engine.end(s, "cancelled")

    # --- replies -----------------------------------------------------------------------

    def _error(self, conn_id: str, code: str, message: str, rid: str | None) -> None:
        self.engine.outbox.to_conn(conn_id, ErrorFrame(code=code, message=message, request_id=rid))
