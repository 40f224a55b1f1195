"""The vLLM engine core: vLLM verifies (its scheduler, paged KV cache and rejection sampler),
specfleet's drafters propose. Implements the same :class:`VerifierCore` as the torch core.

    AddRequest -> one long-lived vLLM request (AsyncLLM.generate, DELTA outputs)
    AddDraft   -> the session's round takes it; a live draft goes to vLLM's worker
                  (one collective_rpc per batch of drafts, at most one in flight); a
                  conditional one (``after``) waits for the round after the one it assumes
    each vLLM output -> pending tokens; a round that is over becomes a Rounded result
    Finish     -> abort the vLLM request

Everything runs on the verifier's event loop: vLLM's heavy work happens in its own engine
process. Rounds are mapped onto vLLM's continuous decoding by :mod:`rounds`. What does not
apply: vLLM's scheduler forms the batches, so ``--batching`` and ``--trim`` (and the step-time
estimator) have no effect here; the draft-length allocators do (their budgets cap each
session's drafts). vLLM verifies every draft as one-hot q, which is lossless for any q; the
q that drafters send is not used. A Draft's ``pause_rounds`` needs nothing here: vLLM never
waits for drafts.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from services.verifier.allocation import Allocator, GoodputTracker, RoundStats
from services.verifier.core_api import (
    AddDraft,
    AddRequest,
    Admitted,
    Attach,
    Attached,
    Command,
    Committed,
    CoreBusy,
    Deliver,
    Detach,
    Ending,
    Finish,
    KVStats,
    RequestRefused,
    Result,
    Rounded,
)
from services.verifier.metrics import VerifierMetrics
from services.verifier.round import DraftBudgets
from services.verifier.vllm_engine.engine import vllm_sampling, vllm_unsupported
from services.verifier.vllm_engine.rounds import LiveSession, Resolved
from shared.log import get_logger
from shared.protocol import FinishReason

log = get_logger("verifier.vllm")
_FINISH: dict[str | None, FinishReason] = {"stop": "stop", "length": "length", "abort": "cancelled"}


@dataclass(frozen=True)
class VllmLimits:
    max_draft_tokens: int  # vLLM's num_speculative_tokens: no budget exceeds it
    max_sessions: int
    vocab_size: int  # the target's: drafts and requests are checked against it
    max_model_len: int


class VllmCore:
    def __init__(self, engine: Any, eos_ids: set[int], allocator: Allocator, tracker: GoodputTracker,
                 limits: VllmLimits, deliver: Deliver, metrics: VerifierMetrics) -> None:
        self.engine = engine
        self.eos_ids = frozenset(eos_ids)
        self.vocab_size, self.max_model_len = limits.vocab_size, limits.max_model_len
        self.allocator, self.tracker, self.limits = allocator, tracker, limits
        self.budgets = DraftBudgets(allocator, tracker, limits.max_draft_tokens)
        self.deliver, self.metrics = deliver, metrics
        metrics.set_policies(allocator.name, "vllm", "none")
        self.sessions: dict[str, LiveSession] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._outbox: list[tuple[str, int, list[int]]] = []  # drafts for vLLM's worker
        self._forget: list[str] = []
        self._rpc: asyncio.Task[None] | None = None
        self._aborts: set[asyncio.Task[None]] = set()
        self._results: list[Result] = []
        self._flush_scheduled = False
        self._closing = False

    # --- the VerifierCore interface ----------------------------------------------------------

    def start(self) -> None:
        log.info("vLLM engine core started", allocation=self.allocator.name,
                 max_draft_tokens=self.limits.max_draft_tokens)

    def submit(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            self._add(command)
        elif isinstance(command, AddDraft):
            self._draft(command)
        elif isinstance(command, Detach):
            self._detach(command.request_id)
        elif isinstance(command, Attach):
            self._attach(command)
        elif isinstance(command, Finish):
            self._finish(command.request_id)
        self._schedule_flush()

    async def failed(self) -> None:
        """Never returns: this core has no loop of its own to die; vLLM's errors fail the requests
        they hit (``_generate``)."""
        await asyncio.get_running_loop().create_future()

    async def aclose(self) -> None:
        """Abort every request, then shut vLLM's engine process down."""
        self._closing = True
        for rid in list(self._tasks):
            self._finish(rid)
        tasks = list(self._tasks.values()) + ([self._rpc] if self._rpc is not None else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.engine.shutdown)

    def kv_stats(self) -> KVStats:
        return KVStats(budget_bytes=0, reserved_bytes=0, cached_tokens=0, sessions=len(self.sessions))

    def draft_share(self) -> float:
        return self.budgets.draft_share()  # everything here runs on the event loop: nothing races it

    def status(self) -> dict[str, object]:
        return {"backend": "vllm", "allocation": self.allocator.name, "batching": "vllm (its own scheduler)",
                "trim": "none", "sessions": len(self.sessions), "rounds": self.tracker.rounds,
                "utility_sum_log_x": round(self.tracker.sum_log_x(), 6)}

    # --- commands ------------------------------------------------------------------------

    def _add(self, cmd: AddRequest) -> None:
        rid = cmd.request_id
        if rid in self.sessions:
            self._results.append(RequestRefused(rid, "invalid", f"request {rid} is already being generated"))
            return
        unsupported = vllm_unsupported(cmd.params)
        if unsupported:
            why = (f"{', '.join(unsupported)}: not supported by the verifier's vLLM backend (--backend vllm); "
                   "use the torch backend")
            self._results.append(RequestRefused(rid, "invalid", why))
            return
        if len(self.sessions) >= self.limits.max_sessions:
            raise CoreBusy(f"the vLLM core holds {self.limits.max_sessions} sessions")
        budget = self.budgets.open(rid, cmd.drafter) if cmd.speculative else 0
        self.sessions[rid] = session = LiveSession(rid, len(cmd.prompt_ids), cmd.speculative, budget,
                                                   drafter=cmd.drafter, draft_at=time.perf_counter(),
                                                   published=list(cmd.generated))
        self._tasks[rid] = asyncio.get_running_loop().create_task(self._generate(session, cmd), name=f"vllm-{rid}")
        self._results.append(Admitted(rid, budget))

    def _draft(self, cmd: AddDraft) -> None:
        session = self.sessions.get(cmd.request_id)
        if session is None:
            return
        if cmd.after is not None:
            offered = session.offer(cmd.round, cmd.after, cmd.token_ids, cmd.received_at)
            if offered != "held":
                self.metrics.conditional.labels(offered).inc()
            if offered != "taken":
                return
        elif not session.take_draft(cmd.round, cmd.token_ids, cmd.received_at, cmd.drafting_s, cmd.ahead):
            return  # a round vLLM already ended without it: the drafter has (or will get) that Verdict
        self.metrics.draft_wait.observe(session.draft_wait_s)
        self._propose(session)

    def _propose(self, session: LiveSession) -> None:
        """Hand the round's draft to vLLM's worker, or end the round when it can do no more."""
        live = session.live_draft()
        if live is not None:
            self._outbox.append((session.request_id, session.base_len, live))
            self._send_drafts()
        elif session.due():
            self._publish(session, finished=False, reason=None)

    def _detach(self, rid: str) -> None:
        session = self.sessions.get(rid)
        if session is None:
            return
        session.detach()
        self.budgets.detach(rid)
        self._forget.append(rid)
        if session.due():
            self._publish(session, finished=False, reason=None)

    def _attach(self, cmd: Attach) -> None:
        session = self.sessions.get(cmd.request_id)
        if session is None:
            return  # finishing: its final Verdict reaches the new drafter
        session.attach(cmd.drafter, self.budgets.open(session.request_id, cmd.drafter), time.perf_counter())
        self._results.append(Attached(session.request_id, list(session.published), session.round, session.budget))

    def _finish(self, rid: str) -> None:
        session = self.sessions.pop(rid, None)
        task = self._tasks.pop(rid, None)
        if session is None and task is None:
            return
        self.budgets.forget(rid)
        self._forget.append(rid)
        aborting = asyncio.get_running_loop().create_task(self._abort(rid, task))
        self._aborts.add(aborting)
        aborting.add_done_callback(self._aborts.discard)

    async def _abort(self, rid: str, task: asyncio.Task[None] | None) -> None:
        try:
            await self.engine.abort(rid)
        except Exception:  # the engine may still hold the request: say so, with its id
            log.exception("vLLM abort failed; the engine may keep the request until it finishes", request_id=rid)
        if task is not None:
            task.cancel()

    # --- vLLM's side -------------------------------------------------------------------------

    async def _generate(self, session: LiveSession, cmd: AddRequest) -> None:
        from vllm.inputs import TokensPrompt

        rid = session.request_id
        try:
            # a re-opened request goes on after its committed tokens, for the tokens still due
            params = msgspec.structs.replace(cmd.params, max_tokens=cmd.params.max_tokens - len(cmd.generated))
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=[*cmd.prompt_ids, *cmd.generated]),
                                                  vllm_sampling(params, self.eos_ids), rid):
                if self.sessions.get(rid) is not session:
                    return
                completion = out.outputs[0]
                session.pending.extend(completion.token_ids)
                if out.finished:
                    self._publish(session, True, _FINISH.get(completion.finish_reason, "stop"))
                    return
                if session.due():
                    self._publish(session, finished=False, reason=None)
                    self._schedule_flush()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed request must not take the server down
            log.exception("vLLM request failed", request_id=rid)
            if self.sessions.get(rid) is session:
                self._publish(session, True, "error", error=f"vLLM failed this request: {exc}")
        finally:
            self._schedule_flush()

    def _send_drafts(self) -> None:
        """At most one collective_rpc in flight; drafts that arrive meanwhile go in the next."""
        if self._rpc is None and (self._outbox or self._forget) and not self._closing:
            self._rpc = asyncio.get_running_loop().create_task(self._rpc_loop(), name="vllm-drafts")

    async def _rpc_loop(self) -> None:
        try:
            while self._outbox or self._forget:
                drafts, forget = self._outbox, self._forget
                self._outbox, self._forget = [], []
                await self.engine.collective_rpc("specfleet_drafts", args=(drafts, forget))
        except Exception:  # the drafts are lost, never the requests: vLLM decodes on without them
            log.exception("could not hand drafts to vLLM's worker")
        finally:
            self._rpc = None

    # --- results -------------------------------------------------------------------------

    def _publish(self, session: LiveSession, finished: bool, reason: FinishReason | None, error: str = "") -> None:
        now = time.perf_counter()
        speculative = session.speculative
        done = session.resolve(now)
        budget = 0
        if finished:
            self.sessions.pop(session.request_id, None)
            self._tasks.pop(session.request_id, None)
            self.budgets.forget(session.request_id)
            self._forget.append(session.request_id)
        elif speculative:
            budget = self._next_budget(session, done)
            self.metrics.count_budget(budget, session.budget)
        session.budget = budget
        ending = Ending(reason, error) if finished else None
        self._results.append(Rounded(session.request_id, done.round, done.drafted, done.accepted,
                                     Committed(done.tokens), budget, ending))
        self.metrics.count_round(done.drafted, done.accepted, len(done.tokens))
        if not finished:
            self._take_upcoming(session)

    def _take_upcoming(self, session: LiveSession) -> None:
        """The new round begins with the conditional draft whose ``after`` the round just ended
        committed, if one came (the drafter reads the same from the Verdict and drafts no other)."""
        taken, dropped = session.promote()
        if dropped:
            self.metrics.conditional.labels("dropped").inc(dropped)
        if taken:
            self.metrics.conditional.labels("taken").inc()
            self.metrics.draft_wait.observe(0.0)
            self._propose(session)

    def _next_budget(self, session: LiveSession, done: Resolved) -> int:
        stats = RoundStats(session.request_id, session.drafter or None, done.drafted, done.accepted,
                           session.base_len, float(done.accepted), session.draft_wait_s, session.drafting_s,
                           session.ahead)
        self.metrics.count_drafter(session.drafter, done.drafted, done.accepted)
        budget = self.budgets.next([stats]).get(session.request_id)
        return budget if budget is not None else self.budgets.hold(session.request_id, 0)  # none assigned: 0

    def _schedule_flush(self) -> None:
        self._send_drafts()
        if self._results and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._results:
            results, self._results = self._results, []
            self.deliver(results)
