"""The torch engine core: a thread that owns the target model, the KV arena and the schedule.

    while running:
        1. drain commands   (new requests, drafts, detaches, finishes)
        2. admit            (reserve KV for waiting requests, oldest first, while it fits)
           share            (copy prompt prefixes other live requests computed: ``prefix.py``)
        3. schedule         (verification rounds, else fill steps, then prefill chunks: ``Scheduler``)
        4. forward          (one packed pass of the target over every segment)
        5. judge + commit   (acceptance maths, token-level stops, KV rollback, next budgets)
        6. deliver          (hand the step's results to the event loop, without waiting)

Two ways to run it, same loop body (``--core-mode``):

* ``thread``: on a thread of its own. The event loop encodes and sends step N's results while
  the core already runs step N+1, so the model never waits for the network. This is the mode
  for a server with cores to spare (and for a GPU, where the forward is asynchronous anyway).
* ``inline``: as a task on the event loop, yielding to it between steps, long enough that the
  drafts that arrived during a step join the next one (``shared.event_loop``). With a single CPU
  there is nothing to overlap with, and the thread mode's cost is pure loss: GIL hand-overs and
  context switches at every step. ``auto`` picks inline when the process may use one CPU.

Only the core touches requests and the arena.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from services.verifier.allocation import Allocator, GoodputTracker, RoundStats, draft_share
from services.verifier.batching.base import slo_met
from services.verifier.core_api import (
    AddDraft,
    AddRequest,
    Admitted,
    Attach,
    Attached,
    Command,
    CoreBusy,
    Deliver,
    Detach,
    Detached,
    Filled,
    Finish,
    KVStats,
    OutOfTurn,
    RequestRefused,
    Result,
    Rounded,
    read_racing,
)
from services.verifier.judge import Judgement, judge, races
from services.verifier.metrics import VerifierMetrics
from services.verifier.prefix import copy_shared, followers
from services.verifier.requests import Request, Status
from services.verifier.scheduler import Scheduler, Step
from services.verifier.status import policy_status
from shared.event_loop import let_io_in
from shared.log import get_logger
from shared.protocol import MAX_CONDITIONAL_DRAFTS, TokenLogprob
from shared.runner import KVError, ModelRunner

log = get_logger("verifier.core")
IDLE_WAKE_S = 0.25  # an idle core still wakes this often to notice silent drafters
EXPIRY_CHECK_S = 0.1  # how often the loop looks for drafters that went silent


@dataclass(frozen=True)
class CoreLimits:
    max_draft_tokens: int
    draft_timeout_s: float
    max_waiting: int  # requests held for KV memory before new ones are refused as busy
    max_commands: int = 65536
    default_slo_tokens_per_s: float | None = None  # SLO class of requests that name none
    recompute_context: bool = False  # SLED-like baseline: no KV reuse across rounds (benchmarks only)
    share_prefixes: bool = True  # copy prompt prefixes other live requests computed (prefix.py)
    race: bool = True  # sample sampled requests by keyed races (shared.race), else from their own stream


class TorchCore:
    def __init__(self, runner: ModelRunner, eos_ids: set[int], allocator: Allocator, scheduler: Scheduler,
                 limits: CoreLimits, deliver: Deliver, metrics: VerifierMetrics, threaded: bool = True) -> None:
        self.runner = runner
        # α̂ and X per session, whatever the policy: the scheduler's, which its candidates read
        self.tracker = scheduler.tracker if scheduler.tracker is not None else GoodputTracker()
        self.estimator = scheduler.estimator  # step time from shapes, refined by every step
        metrics.set_policies(allocator.name, scheduler.batcher.name, scheduler.trim.name)
        self.vocab_size = runner.vocab_size
        self.max_model_len = runner.max_model_len
        self.eos_ids = frozenset(eos_ids)
        self.allocator, self.scheduler, self.limits = allocator, scheduler, limits
        self.deliver, self.metrics = deliver, metrics
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # One ordered stream. AddRequest/AddDraft beyond max_commands are refused (CoreBusy);
        # Detach/Finish never are: they free work, and there is at most one per session.
        self._commands: queue.Queue[Command | None] = queue.Queue()
        self._results: list[Result] = []
        self._running = False
        self.threaded = threaded
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None  # inline mode: set by submit()
        self._last_step_start = self._last_forward_end = 0.0
        self._last_forward_cpu, self._last_sessions = 0.0, 0  # process CPU seconds at it; its step's sessions
        self._expiry_checked = 0.0

    # --- the VerifierCore interface (event loop thread) -------------------------------------

    def start(self) -> None:
        """Start serving: a thread of its own, or (inline) a task on the running event loop."""
        self._running = True
        log.info("engine core started", mode="thread" if self.threaded else "inline",
                 allocation=self.allocator.name, batching=self.scheduler.batcher.name, trim=self.scheduler.trim.name)
        if self.threaded:
            self._thread = threading.Thread(target=self._run_thread, name="verifier-core", daemon=True)
            self._thread.start()
        else:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run_inline(), name="verifier-core")

    def submit(self, command: Command) -> None:
        if not isinstance(command, Detach | Attach | Finish) and self._commands.qsize() >= self.limits.max_commands:
            raise CoreBusy(f"the verifier core has {self.limits.max_commands} commands queued")
        self._commands.put_nowait(command)
        if self._wake is not None:
            self._wake.set()

    async def aclose(self) -> None:
        """Stop serving and wait until the loop has ended."""
        self._running = False
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await self._task
        if self._thread is not None:
            self._commands.put_nowait(None)  # a wake-up; _running is already False
            await asyncio.to_thread(self._thread.join, 30)

    def status(self) -> dict[str, object]:
        """The policies and their live estimates, for ``GET /status``."""
        return read_racing(lambda: {**policy_status(self.allocator, self.scheduler, self.tracker, self.estimator),
                                    "sampling": "race" if self.limits.race else "stream",
                                    **self.runner.describe()},
                           {"error": "the engine core was too busy to read; retry"})

    def draft_share(self) -> float:
        return read_racing(lambda: draft_share(self.allocator, self.tracker), 1.0)

    def kv_stats(self) -> KVStats:
        kv = self.runner.kv
        return KVStats(budget_bytes=kv.budget_bytes, reserved_bytes=kv.reserved_tokens * kv.shape.bytes_per_token,
                       cached_tokens=kv.cached_tokens, sessions=kv.sessions, waiting=len(self.waiting))

    # --- the loop ------------------------------------------------------------------------

    def _run_thread(self) -> None:
        while self._running:
            self._iterate(self._idle_s())

    async def _run_inline(self) -> None:
        assert self._wake is not None
        while self._running:
            idle_s = self._idle_s()
            if idle_s > 0 and self._commands.empty():
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(idle_s):
                        await self._wake.wait()
            self._iterate(0.0)
            await let_io_in()  # read the frames that arrived during the step, send this step's results

    def _iterate(self, block_s: float) -> None:
        """One turn of the loop: commands (waiting up to ``block_s`` for one), admission, at most
        one step, results out."""
        self._drain(block_s)
        scheduled = time.perf_counter()
        self._expire_silent_drafters()
        self._admit()
        step = self.scheduler.schedule(self.requests.values(), hold=self._share_prefixes())
        if step.verify:
            self.metrics.batch_decision.observe(self.scheduler.last_decision_s)
            self.metrics.trimmed.inc(self.scheduler.last_trimmed)
        if step:
            self._step(step, scheduled)
        self._flush()

    def _share_prefixes(self) -> set[int]:
        """Copy shared prompt prefixes into requests still prefilling; those to hold this step."""
        if not self.limits.share_prefixes or self.limits.recompute_context:
            return set()
        copied = copy_shared(self.requests.values(), self.runner.kv)
        if copied:
            self.metrics.shared_tokens.inc(copied)
        return followers(self.requests.values())

    def _has_work(self) -> bool:
        return any(self.scheduler.verifiable(r) or (r.slot is not None and r.to_prefill > 0)
                   for r in self.requests.values()) or self._can_admit()

    def _idle_s(self) -> float:
        """How long the loop may wait for a command: 0 with work to do now, else until a fill step
        may run (``fill``), at most IDLE_WAKE_S."""
        if self._has_work():
            return 0.0
        wait = self.scheduler.fill_wait_s(self.requests.values())
        return IDLE_WAKE_S if wait is None else min(IDLE_WAKE_S, wait)

    def _drain(self, block_s: float) -> None:
        """Handle every queued command, in order; wait up to ``block_s`` for the first."""
        try:
            command = self._commands.get(timeout=block_s) if block_s > 0 else self._commands.get_nowait()
            while True:
                if command is not None:  # None is only a wake-up
                    self._handle(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _flush(self) -> None:
        if self._results:
            results, self._results = self._results, []
            self.deliver(results)

    # --- commands ------------------------------------------------------------------------

    def _handle(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            self._add(command)
        elif isinstance(command, AddDraft):
            self._draft(command)
        elif isinstance(command, Detach):
            req = self.requests.get(command.request_id)
            if req is not None:
                req.detach()
                self.tracker.detach(req.request_id)
        elif isinstance(command, Attach):
            self._attach(command)
        elif isinstance(command, Finish):
            req = self.requests.get(command.request_id)
            if req is not None:
                req.finish("cancelled")
                self._retire(req)

    def _add(self, cmd: AddRequest) -> None:
        req = Request.create(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.speculative, self.max_model_len,
                             self.eos_ids, cmd.drafter, cmd.slo_tokens_per_s or self.limits.default_slo_tokens_per_s,
                             cmd.generated, race=self.limits.race)
        req.grammar = cmd.grammar
        req.arrived_at -= cmd.waited_s
        if req.grammar is not None and cmd.generated:  # a re-opened request: its grammar resumes where its text is
            req.grammar.advance(cmd.generated)
        need = req.kv_tokens_needed(self.limits.max_draft_tokens)
        must_wait = bool(self.waiting) or not self.runner.kv.fits(need)
        if need > self.runner.kv.tokens:
            self._results.append(RequestRefused(cmd.request_id, "invalid", (
                f"the request needs {need} tokens of KV cache but the verifier holds {self.runner.kv.tokens} in all; "
                "ask for fewer max_tokens or raise the verifier's --kv-cache-gb")))
        elif must_wait and len(self.waiting) >= self.limits.max_waiting:
            self._results.append(RequestRefused(cmd.request_id, "busy", (
                f"the verifier's KV cache is full and {len(self.waiting)} requests already wait for it; retry later")))
        else:
            self.requests[req.request_id] = req
            self.waiting.append(req)
            self._admit()

    def _draft(self, cmd: AddDraft) -> None:
        req = self.requests.get(cmd.request_id)
        if cmd.after is not None:
            self._conditional(req, cmd)
            return
        if req is None or req.status is not Status.WAITING_DRAFT or cmd.round != req.round:
            where = f"round {req.round}" if req is not None else "no open session"
            self._results.append(OutOfTurn(cmd.request_id, f"session {cmd.request_id} expects {where}, "
                                                           f"got a draft for round {cmd.round}"))
            return
        self._take(req, cmd)

    def _conditional(self, req: Request | None, cmd: AddDraft) -> None:
        """A draft sent before the Verdict it assumes (``Draft.after``): kept for the next round,
        taken at once when that Verdict already went out with exactly its ``after``, and otherwise
        dropped without a word (the drafter drafts the round afresh when the Verdict tells it)."""
        if req is None or req.status is Status.FINISHED:
            return
        if cmd.round == req.round + 1 and len(req.upcoming) < MAX_CONDITIONAL_DRAFTS:
            req.upcoming.append(cmd)
        elif cmd.round == req.round and req.status is Status.WAITING_DRAFT and cmd.after == req.last_tokens:
            self._take(req, cmd)
            self.metrics.conditional.labels("taken").inc()
        else:
            self.metrics.conditional.labels("dropped").inc()

    def _take(self, req: Request, cmd: AddDraft) -> None:
        """The draft of the round the session waits for."""
        req.pause_left = cmd.pause_rounds
        req.guess_bonus = (cmd.guess_bonus and not req.greedy and req.race_key is None  # shared.coupling
                           and req.params.seed is None)
        wait = req.draft_wait_s = max(0.0, cmd.received_at - req.waiting_since)
        self.metrics.draft_wait.observe(wait)
        if cmd.after is None:  # a conditional one was there before the round: it says nothing of the wait
            self.metrics.observe_fill_wait(req.drafter, wait, self.scheduler.fill.observe(req.drafter, wait))
        req.take_draft(cmd.token_ids, cmd.q, cmd.confidence)

    def _attach(self, cmd: Attach) -> None:
        req = self.requests.get(cmd.request_id)
        if req is None or req.status is Status.FINISHED:
            return  # finishing: its final Verdict reaches the new drafter
        self.tracker.open(req.request_id, cmd.drafter or None)
        if req.slot is not None and req.status is Status.READY:  # its next round may be drafted again
            req.draft_budget = self._initial_budget(req.request_id)
        if not req.attach(cmd.drafter):
            return  # waiting for KV memory: Admitted opens it
        self._results.append(Attached(req.request_id, req.committed[req.prompt_len:], req.round, req.draft_budget,
                                      req.bonus_key, req.race_key))

    def _expire_silent_drafters(self) -> None:
        now = time.perf_counter()
        if now - self._expiry_checked < EXPIRY_CHECK_S:
            return
        self._expiry_checked = now
        for req in self.requests.values():
            if req.status is Status.WAITING_DRAFT and now - req.waiting_since > self.limits.draft_timeout_s:
                log.warning("no draft in time; session continues target-only", request_id=req.request_id,
                            waited_s=round(now - req.waiting_since, 1))
                req.detach()
                self.tracker.detach(req.request_id)
                self._results.append(Detached(req.request_id))

    # --- admission -----------------------------------------------------------------------

    def _can_admit(self) -> bool:
        return bool(self.waiting) and self.runner.kv.fits(
            self.waiting[0].kv_tokens_needed(self.limits.max_draft_tokens))

    def _admit(self) -> None:
        if not self._can_admit():
            return
        while self._can_admit():
            req = self.waiting.popleft()
            req.slot = self.runner.kv.allocate(req.kv_tokens_needed(self.limits.max_draft_tokens))
            if req.speculative:
                self.tracker.open(req.request_id, req.drafter or None)
            budget = self._initial_budget(req.request_id) if req.speculative else 0
            req.draft_budget = budget
            req.begin_round()
            if req.reattached and req.speculative:  # a drafter resumed it while it waited: tell it where it is
                self._results.append(Attached(req.request_id, req.committed[req.prompt_len:], req.round, budget,
                                              req.bonus_key, req.race_key))
            else:
                self._results.append(Admitted(req.request_id, budget, req.bonus_key, req.race_key))
        self.metrics.set_kv(self.kv_stats())

    def _initial_budget(self, session_id: str) -> int:
        budget = min(self.allocator.initial(session_id, self.tracker), self.limits.max_draft_tokens)
        self.tracker.set_budget(session_id, budget)
        return budget

    # --- one step --------------------------------------------------------------------------

    def _step(self, step: Step, scheduled: float) -> None:
        t0, proc0 = time.perf_counter(), time.process_time()
        for req, _ in step.verify:
            self.metrics.queue_wait.observe(t0 - req.ready_since)
        cpu0 = time.thread_time()
        try:
            logits = self.runner.forward(step.segments)
            t1, cpu1, proc1 = time.perf_counter(), time.thread_time(), time.process_time()
            self.metrics.observe_estimate(self.estimator.predict(step.shapes), t1 - t0)
            self.estimator.observe(step.shapes, t1 - t0)
            judged = [*step.verify, *((req, []) for req in step.fill)]
            verdicts = judge(judged, logits) if judged and logits is not None else []
        except (KVError, RuntimeError, ValueError) as exc:  # fail this step's sessions, keep serving
            log.exception("verification step failed", sessions=len(step.segments))
            for req in [r for r, _ in step.verify] + step.fill + step.prefill:
                self._fail(req, f"verification failed: {exc}")
            self._last_forward_end = 0.0  # the time to the next step is no gap of a step's period
            return
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
            drafted, accepted, _ = req.round_outcome(len(drafts), v.accepted, v.accept_prob)
            self._publish_round(req, drafted, accepted, k, budgets.get(req.request_id, 0), logprobs)
        self.metrics.observe_step(step, scheduled, t0, t1, time.perf_counter(), self._last_step_start, cpu1 - cpu0)
        if self._last_forward_end:
            self.scheduler.trim.observe_gap(t0 - self._last_forward_end)
            # the CPU the verifier's process spent from the last forward's end to this one's start
            # (idle waits for drafts cost none), at most the wall time: its work per step. All its
            # threads count (thread mode's event loop too, and a /status or /metrics scrape)
            busy = min(t0 - self._last_forward_end, proc0 - self._last_forward_cpu)
            self.estimator.overhead.observe(self._last_sessions, busy)
        self._last_forward_cpu, self._last_sessions = proc1, len(step.segments)
        # with no session left, the time to the next step is idleness between requests, not a gap
        self._last_step_start, self._last_forward_end = t0, (t1 if self.requests else 0.0)

    def _next_budgets(self, step: Step, verdicts: list[Judgement]) -> dict[str, int]:
        """Fold the speculating sessions' rounds into the tracker; the allocator's next budgets."""
        rounds = [_round_stats(req, len(d), v) for (req, d), v in zip(step.verify, verdicts, strict=True)
                  if req.speculative and req.status is not Status.FINISHED]
        for r in rounds:
            self.tracker.observe(r)
            self.metrics.count_drafter(r.drafter or "", r.accepted)
        started = time.perf_counter()
        budgets = self.allocator.assign(rounds, self.tracker) if rounds else {}
        self.metrics.allocation_time.observe(time.perf_counter() - started)
        for req, _ in step.verify:  # rounds the drafter asked to run without it: budget 0
            if req.pause_left > 0 and req.request_id in budgets:
                budgets[req.request_id] = 0
                req.pause_left -= 1
        for sid, budget in budgets.items():
            self.tracker.set_budget(sid, min(budget, self.limits.max_draft_tokens))
        if rounds:
            self.metrics.observe_allocation(self.tracker)
        return budgets

    def _commit(self, req: Request, drafts: list[int], accepted: int, tokens: list[int]) -> list[int]:
        """Roll the KV back past rejected drafts and commit the round's tokens; returns those kept."""
        assert req.slot is not None
        keep = 0 if self.limits.recompute_context else req.slot.length - (len(drafts) - accepted)
        req.slot.truncate(keep)  # keep the accepted drafts' keys/values (none: the next round recomputes all)
        self.scheduler.trim.observe_round(req.drafter, req.draft_conf, len(drafts), accepted)  # the trim's calibration
        return req.commit(tokens)

    def _fill(self, req: Request, v: Judgement) -> None:
        """A token decoded while the session's draft travels: committed now and streamed to the
        client; its drafter hears of it with the round's Verdict (``Rounded.prior``)."""
        kept = self._commit(req, [], 0, v.tokens)
        logprobs = v.logprobs[: len(kept)] if v.logprobs is not None else None
        self.metrics.filled.inc(len(kept))
        if req.status is Status.FINISHED:  # the round ends here: the drafter's draft for it is moot
            self._publish_round(req, 0, 0, kept, 0, logprobs)  # counts the tokens generated
            return
        self.metrics.generated.inc(len(kept))
        self._results.append(Filled(req.request_id, req.round, kept, list(req.fill), logprobs))
        req.fill.extend(kept)

    def _publish_round(self, req: Request, drafted: int, accepted: int, kept: list[int], budget: int,
                       logprobs: list[TokenLogprob] | None = None) -> None:
        finished = req.status is Status.FINISHED
        budget = 0 if finished or not req.speculative else min(budget, self.limits.max_draft_tokens)
        self._results.append(Rounded(req.request_id, req.round, drafted, accepted, kept, finished,
                                     req.finish_reason, budget, logprobs=logprobs, prior=list(req.fill)))
        self.metrics.count_round(drafted, accepted, len(kept))
        if finished:
            self._retire(req)
        else:
            if req.speculative:
                self.metrics.count_budget(budget, req.draft_budget)
            req.draft_budget = budget
            upcoming = req.next_round((*req.fill, *kept))
            if req.status is Status.WAITING_DRAFT:
                self._take_upcoming(req, upcoming)
            elif upcoming:  # the round runs without a draft (budget 0, or no drafter)
                self.metrics.conditional.labels("dropped").inc(len(upcoming))

    def _take_upcoming(self, req: Request, upcoming: list[AddDraft]) -> None:
        """The conditional draft whose ``after`` the round just ended committed, if one came."""
        came_true = next((cmd for cmd in upcoming if cmd.after == req.last_tokens), None)
        if upcoming:
            self.metrics.conditional.labels("dropped").inc(len(upcoming) - (came_true is not None))
        if came_true is not None:
            self._take(req, came_true)
            self.metrics.conditional.labels("taken").inc()

    def _fail(self, req: Request, error: str) -> None:
        req.finish("error")
        self._results.append(Rounded(req.request_id, req.round, 0, 0, [], True, "error", 0, error=error))
        self._retire(req)

    def _retire(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        if req.slot is not None:
            self.runner.kv.free(req.slot)
            req.slot = None
        elif req in self.waiting:
            self.waiting.remove(req)
        self.tracker.forget(req.request_id)
        if req.finish_reason in ("stop", "length"):
            self.metrics.count_slo(req.slo_tokens_per_s,
                                   slo_met(req.arrived_at, req.generated, req.slo_tokens_per_s, time.perf_counter()))
        self.metrics.set_kv(self.kv_stats())


def _round_stats(req: Request, verified: int, v: Judgement) -> RoundStats:
    """What the allocator learns from a verified round (the fill's matches included)."""
    drafted, accepted, accept_prob = req.round_outcome(verified, v.accepted, v.accept_prob)
    return RoundStats(req.request_id, req.drafter or None, drafted, accepted, len(req.committed), accept_prob,
                      req.draft_wait_s)
