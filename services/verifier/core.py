"""The torch engine core: a thread that owns the target model, the KV arena and the schedule.

    while running:
        1. take inputs   (new requests, drafts, detaches, finishes: ``RequestTable``, ``RoundLifecycle``)
        2. admit         (reserve KV for waiting requests, oldest first, while it fits)
                         and share prompt prefixes other live requests computed (``prefix.py``)
        3. schedule      (verification rounds, else fill steps, then prefill chunks: ``Scheduler``)
        4. forward       (one packed pass of the target over every segment)
        5. judge, commit (acceptance maths, token-level stops, KV rollback, next budgets: ``round``)
        6. publish       (the step's results to the event loop, without waiting; a fresh snapshot
                          of the policies' state for ``/status``)

Two ways to run it, same loop body (``--core-mode``):

* ``thread``: on a thread of its own. The event loop encodes and sends step N's results while
  the core already runs step N+1, so the model never waits for the network. This is the mode
  for a server with cores to spare (and for a GPU, where the forward is asynchronous anyway).
* ``inline``: as a task on the event loop, yielding to it between steps, long enough that the
  drafts that arrived during a step join the next one (``shared.event_loop``). With a single CPU
  there is nothing to overlap with, and the thread mode's cost is pure loss: GIL hand-overs and
  context switches at every step. ``auto`` picks inline when the process may use one CPU.

Only the core touches requests and the arena; the event loop reads the snapshots it publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field

from services.verifier.allocation import Allocator, GoodputTracker
from services.verifier.core_api import (
    AddDraft,
    AddRequest,
    Attach,
    Command,
    CoreBusy,
    CoreDied,
    Deliver,
    Detach,
    Finish,
    KVStats,
    Result,
)
from services.verifier.judge import judge
from services.verifier.metrics import VerifierMetrics
from services.verifier.prefix import copy_shared, followers
from services.verifier.request_table import CoreLimits, RequestTable, TargetLimits
from services.verifier.round.budgets import DraftBudgets
from services.verifier.round.lifecycle import RoundLifecycle
from services.verifier.scheduler import Scheduler, Step
from services.verifier.status import policy_status
from shared.event_loop import let_io_in
from shared.log import get_logger
from shared.runner import KVError, ModelRunner

log = get_logger("verifier.core")
IDLE_WAKE_S = 0.25  # an idle core still wakes this often to notice silent drafters
SNAPSHOT_EVERY_S = 0.1  # a core holding requests publishes its state for /status at most this often

__all__ = ["CoreLimits", "Snapshot", "TorchCore"]


@dataclass(frozen=True)
class Snapshot:
    """What the event loop may read of the core: published by the core, never live state."""

    status: dict[str, object] = field(default_factory=lambda: {"status": "starting"})
    draft_share: float = 1.0
    kv: KVStats = field(default_factory=lambda: KVStats(0, 0, 0, 0))


@dataclass
class _Timing:
    """When the last steps ran: the estimator's, the trim's and the metrics' inputs."""

    step_start: float = 0.0
    forward_end: float = 0.0  # 0: the next step follows no step (the first, or one after a failure)
    forward_cpu: float = 0.0  # process CPU seconds at the last forward's end
    sessions: int = 0  # the last step's segments
    published: float = 0.0  # when the last snapshot went out


class TorchCore:
    def __init__(self, runner: ModelRunner, eos_ids: set[int], allocator: Allocator, scheduler: Scheduler,
                 limits: CoreLimits, deliver: Deliver, metrics: VerifierMetrics, threaded: bool = True) -> None:
        self.runner, self.scheduler, self.limits = runner, scheduler, limits
        self.deliver, self.metrics = deliver, metrics
        self.vocab_size, self.max_model_len = runner.vocab_size, runner.max_model_len
        self.allocator, self.estimator = allocator, scheduler.estimator
        # α̂ and X per session, whatever the policy: the scheduler's, which its candidates read
        tracker = scheduler.tracker if scheduler.tracker is not None else GoodputTracker()
        self.budgets = DraftBudgets(allocator, tracker, limits.max_draft_tokens)
        metrics.set_policies(allocator.name, scheduler.batcher.name, scheduler.trim.name)
        self._results: list[Result] = []
        self.table = RequestTable(runner.kv, self.budgets, limits, TargetLimits(frozenset(eos_ids), self.max_model_len),
                                  self._results, metrics)
        self.rounds = RoundLifecycle(self.budgets, scheduler.trim, scheduler.fill, metrics, self._results,
                                     self.table.retire, recompute_context=limits.recompute_context)
        # One ordered stream. AddRequest/AddDraft beyond max_commands are refused (CoreBusy);
        # Detach/Finish never are: they free work, and there is at most one per session.
        self._commands: queue.Queue[Command | None] = queue.Queue()
        self._running, self.threaded = False, threaded
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None  # inline mode: set by submit()
        self._died: asyncio.Future[None] | None = None  # failed() waits on it; set when the loop dies
        self._timing = _Timing()
        self._snapshot = Snapshot()
        self._changed = False  # something happened since the last snapshot
        self._publish_snapshot()

    # --- the VerifierCore interface (event loop thread) -------------------------------------

    def start(self) -> None:
        """Start serving: a thread of its own, or (inline) a task on the running event loop."""
        self._running = True
        loop = asyncio.get_running_loop()
        self._died = loop.create_future()
        log.info("engine core started", mode="thread" if self.threaded else "inline",
                 allocation=self.allocator.name, batching=self.scheduler.batcher.name, trim=self.scheduler.trim.name)
        if self.threaded:
            self._thread = threading.Thread(target=self._run_thread, args=(loop,), name="verifier-core", daemon=True)
            self._thread.start()
        else:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run_inline(), name="verifier-core")
            self._task.add_done_callback(lambda t: self._died_of(None if t.cancelled() else t.exception()))

    async def failed(self) -> None:
        assert self._died is not None, "start() first"
        await asyncio.shield(self._died)

    def _died_of(self, exc: BaseException | None) -> None:
        """The loop ended (event loop thread): an error while still running fails :meth:`failed`."""
        if exc is None or not self._running or self._died is None or self._died.done():
            return
        self._died.set_exception(CoreDied(f"the verifier's engine core stopped: {exc!r}"))

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
            await asyncio.gather(self._task, return_exceptions=True)  # its error went to failed()
        if self._thread is not None:
            self._commands.put_nowait(None)  # a wake-up; _running is already False
            await asyncio.to_thread(self._thread.join, 30)
        if self._thread is None or not self._thread.is_alive():  # the loop has ended: no step reads the KV again
            self.runner.kv.release()

    def status(self) -> dict[str, object]:
        """The policies and their estimates as last published, for ``GET /status``."""
        return self._snapshot.status

    def draft_share(self) -> float:
        return self._snapshot.draft_share

    def kv_stats(self) -> KVStats:
        return self._snapshot.kv

    # --- the loop ------------------------------------------------------------------------

    def _run_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while self._running:
                self._iterate(self._idle_s())
        except Exception as exc:  # told to the event loop, whose failed() ends the verifier
            log.exception("the engine core stopped with an error; the verifier exits")
            with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is left to tell
                loop.call_soon_threadsafe(self._died_of, exc)

    async def _run_inline(self) -> None:
        assert self._wake is not None
        try:
            while self._running:
                idle_s = self._idle_s()
                if idle_s > 0 and self._commands.empty():
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(idle_s):
                            await self._wake.wait()
                self._iterate(0.0)
                await let_io_in()  # read the frames that arrived during the step, send this step's results
        except Exception:  # the task's done callback tells failed()
            log.exception("the engine core stopped with an error; the verifier exits")
            raise

    def _iterate(self, block_s: float) -> None:
        """One turn of the loop: inputs (waiting up to ``block_s`` for one), admission, at most
        one step, results out."""
        self._changed |= self._drain(block_s)  # 1. take inputs
        scheduled = time.perf_counter()
        self.table.expire_silent_drafters()  # 2. admit
        self.table.admit()
        step = self.scheduler.schedule(self.table.requests.values(), hold=self._share_prefixes())  # 3. schedule
        if step.verify:
            self.metrics.batch_decision.observe(self.scheduler.last_decision_s)
            self.metrics.trimmed.inc(self.scheduler.last_trimmed)
        if step:
            self._step(step, scheduled)  # 4. forward, 5. judge and commit
            self._changed = True
        self._publish()  # 6. publish

    def _share_prefixes(self) -> set[int]:
        """Copy shared prompt prefixes into requests still prefilling; those to hold this step."""
        if not self.limits.share_prefixes or self.limits.recompute_context:
            return set()
        copied = copy_shared(self.table.requests.values(), self.runner.kv)
        if copied:
            self.metrics.shared_tokens.inc(copied)
        return followers(self.table.requests.values())

    def _has_work(self) -> bool:
        return any(self.scheduler.verifiable(r) or (r.slot is not None and r.to_prefill > 0)
                   for r in self.table.requests.values()) or self.table.can_admit()

    def _idle_s(self) -> float:
        """How long the loop may wait for a command: 0 with work to do now, else until a fill step
        may run (``fill``), at most IDLE_WAKE_S."""
        if self._has_work():
            return 0.0
        wait = self.scheduler.fill_wait_s(self.table.requests.values())
        return IDLE_WAKE_S if wait is None else min(IDLE_WAKE_S, wait)

    def _drain(self, block_s: float) -> bool:
        """Handle every queued command, in order; wait up to ``block_s`` for the first. Whether any came."""
        came = False
        try:
            command = self._commands.get(timeout=block_s) if block_s > 0 else self._commands.get_nowait()
            while True:
                if command is not None:  # None is only a wake-up
                    self._handle(command)
                    came = True
                command = self._commands.get_nowait()
        except queue.Empty:
            return came

    def _handle(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            self.table.add(command)
        elif isinstance(command, AddDraft):
            self.rounds.draft(self.table.get(command.request_id), command)
        elif isinstance(command, Detach):
            self.table.detach(command.request_id)
        elif isinstance(command, Attach):
            self.table.attach(command)
        elif isinstance(command, Finish):
            self.table.cancel(command.request_id)

    def _publish(self) -> None:
        """The step's results to the event loop; before them, when something changed, a snapshot:
        at most every SNAPSHOT_EVERY_S while requests are held (a speculating core idles between
        rounds, so "no work now" would mean every step), and at once when the last one has gone."""
        drained = not self.table.requests and not self.table.waiting
        if self._changed and (drained or time.perf_counter() - self._timing.published >= SNAPSHOT_EVERY_S):
            self._publish_snapshot()
        if self._results:
            results = self._results.copy()
            self._results.clear()  # the table and the rounds append to this very list
            self.deliver(results)

    def _publish_snapshot(self) -> None:
        status = {**policy_status(self.allocator, self.scheduler, self.budgets.tracker, self.estimator),
                  "sampling": "race" if self.limits.race else "stream", **self.runner.describe()}
        self._snapshot = Snapshot(status, self.budgets.draft_share(), self.table.stats())
        self._timing.published, self._changed = time.perf_counter(), False

    # --- one step --------------------------------------------------------------------------

    def _step(self, step: Step, scheduled: float) -> None:
        t0, proc0, cpu0 = time.perf_counter(), time.process_time(), time.thread_time()
        for req, _ in step.verify:
            self.metrics.queue_wait.observe(t0 - req.ready_since)
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
                self.rounds.fail(req, f"verification failed: {exc}")
            self._timing.forward_end = 0.0  # the time to the next step is no gap of a step's period
            return
        generated = self.metrics.generated_total
        self.rounds.close(step, verdicts)
        live = self.table.requests.values()
        self.budgets.served(len(live), self.metrics.generated_total - generated,
                            sum(r.cached for r in live) / len(live) if live else 0.0)
        self.metrics.observe_step(step, scheduled, t0, t1, time.perf_counter(), self._timing.step_start, cpu1 - cpu0)
        self._observe_gap(t0, proc0, len(step.segments))
        self._timing.forward_cpu = proc1
        # with no session left, the time to the next step is idleness between requests, not a gap
        self._timing.step_start, self._timing.forward_end = t0, (t1 if self.table.requests else 0.0)

    def _observe_gap(self, t0: float, proc0: float, sessions: int) -> None:
        """The time from the last forward's end to this one's start: the trim's gap, and the CPU the
        verifier's process spent in it (idle waits for drafts cost none), at most the wall time: its
        work per step. All its threads count (thread mode's event loop too, and a /status scrape)."""
        timing = self._timing
        if timing.forward_end:
            self.scheduler.trim.observe_gap(t0 - timing.forward_end)
            busy = min(t0 - timing.forward_end, proc0 - timing.forward_cpu)
            self.estimator.overhead.observe(timing.sessions, busy)
        timing.sessions = sessions
