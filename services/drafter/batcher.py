"""Work-conserving batched drafting (StarSD §3): one draft model, many sessions.

Session tasks do not call the draft model themselves. Each hands its round's ``DraftJob`` to
the batcher and awaits the proposal. The batcher's loop is short:

    while running:
        1. wait until at least one job is ready (the draft model idles only when none is), then
           let the verdicts that arrived with it, or during the last batch, in
           (``shared.event_loop``: with inline compute the loop was blocked meanwhile);
        2. take every ready job (up to ``max_batch``) and draft them together: one forward per
           draft position for the whole batch, on the compute worker;
        3. hand each session its proposal.

With a stepping proposer (the draft model's, ``proposers/base.py``) a batch of rounds runs one
forward at a time, and between forwards the event loop reads the verdicts that came meanwhile:
their sessions' next rounds join the batch at its next forward, and each session gets its draft
as soon as it is done (continuous batching, as vLLM's scheduler does for the target). Without it,
a verdict that came while a batch drafted waited for the batch's end (a whole round: k forwards,
and on one CPU the event loop itself was blocked), and the sessions split into batches that took
turns, each of fewer rows: at 4 sessions on an edge core, two batches of about 2 (a row costs far
less in a larger batch). With other proposers, sessions whose verdicts come back while a batch is
drafting form the next batch. Either way the draft model stays busy as long as any session is
ready, and network I/O (on the event loop) never waits for it. Lookaheads (``lookahead.py``) only
use time the model would otherwise idle.
The metrics give StarSD's quantities: the draft model's idle fraction (T_idle), each job's
wait for the model (T_wait) and the batch sizes; ``capacity`` turns the batch timings into
StarSD's per-session service time S.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from services.drafter.control.capacity import Capacity
from services.drafter.metrics import DrafterMetrics
from services.drafter.proposers.base import DraftJob, DraftRun, Proposal, Proposer, SteppingProposer
from services.drafter.worker import ComputeWorker
from shared.event_loop import let_io_in
from shared.log import get_logger

log = get_logger("drafter.batcher")
T = TypeVar("T")
#: what a session awaits for its job: the proposal, and when its drafting started and ended
Pending = asyncio.Future[tuple[Proposal, float, float]]
#: a job, when it became ready, and its future
Ready = tuple[DraftJob, float, Pending]
#: a stepped run's jobs by id: their futures, and when each began drafting (0: not yet)
Waiting = dict[int, tuple[Pending, float]]


class DraftBatcher:
    def __init__(self, proposer: Proposer, worker: ComputeWorker, metrics: DrafterMetrics | None = None,
                 max_batch: int = 64) -> None:
        self.proposer = proposer
        self.worker = worker
        self.metrics = metrics or DrafterMetrics()
        self.max_batch = max_batch
        self.capacity = Capacity()
        self._ready: list[Ready] = []
        self._wake = asyncio.Event()
        self._shared_seen = 0  # the proposer's shared_prefix_tokens already counted in the metrics
        self._looked_up_seen = (0, 0)  # ... and its looked_up, looked_up_kept

    async def propose(self, job: DraftJob) -> tuple[Proposal, float, float]:
        """The job's proposal, and when its batch started and ended drafting."""
        fut: Pending = asyncio.get_running_loop().create_future()
        self._ready.append((job, time.perf_counter(), fut))
        self._wake.set()
        return await fut

    async def run(self) -> None:
        """Draft batches until cancelled."""
        idle_since = time.perf_counter()
        while True:
            if not self._ready:
                self._wake.clear()
                await self._wake.wait()
            await let_io_in(handoffs=1)  # jobs of verdicts that came with this one (or during the last batch) join it
            began = time.perf_counter()
            self.metrics.draft_idle.inc(began - idle_since)
            batch = self._next_batch()
            if batch:
                await self._draft(batch, began)
            idle_since = time.perf_counter()

    def _next_batch(self) -> list[Ready]:
        """Up to ``max_batch`` ready jobs, oldest first. Lookaheads (jobs that assume a draft in
        flight) only fill time the draft model would otherwise idle: they run when no round is
        waiting to be drafted, never beside one, so they cannot slow a real round down."""
        self._ready = [item for item in self._ready if not item[2].done()]
        rounds = [item for item in self._ready if not item[0].after.assume]
        batch = (rounds or self._ready)[: self.max_batch]
        taken = {id(item) for item in batch}
        self._ready = [item for item in self._ready if id(item) not in taken]
        return batch

    async def _draft(self, batch: list[Ready], began: float) -> None:
        for _, queued, _ in batch:
            self.metrics.job_wait.observe(began - queued)
        if isinstance(self.proposer, SteppingProposer) and not batch[0][0].after.assume:
            await self._draft_steps(self.proposer, batch)
            return
        self.metrics.batch_size.labels("lookahead" if batch[0][0].after.assume else "round").observe(len(batch))
        try:
            proposals, started, ended, cpu = await self.worker.run(_timed, self.proposer.propose,
                                                                   [j for j, _, _ in batch])
        except Exception as exc:  # every session of the batch goes on without drafts (rounds.py)
            log.exception("batched drafting failed", sessions=len(batch))
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        self.metrics.draft_busy.inc(ended - started)
        self.metrics.draft_cpu.inc(cpu)
        self._count_shared()
        if batch[0][0].after.assume:  # a batch is all rounds or all lookaheads (_next_batch)
            self.metrics.lookahead_busy.inc(ended - started)
            self.metrics.lookahead_cpu.inc(cpu)
        else:
            self.capacity.observe_batch(ended - started, len(batch))
        for (_, _, fut), proposal in zip(batch, proposals, strict=True):
            if not fut.done():
                fut.set_result((proposal, started, ended))

    async def _draft_steps(self, proposer: SteppingProposer, batch: list[Ready]) -> None:
        """A batch of rounds one forward at a time: after each, the finished ones get their drafts and
        the rounds that became ready join. A run cut short (an error; the task cancelled when the
        verifier link drops) is abandoned, so its sessions' caches go back."""
        waiting: Waiting = {id(job): (fut, 0.0) for job, _, fut in batch}
        run: DraftRun | None = None
        try:
            run = await self.worker.run(proposer.begin, [job for job, _, _ in batch])
            self._hand_out(run, waiting, time.perf_counter())  # the jobs that draft nothing
            busy = 0.0  # drafting time since the service time was last observed
            while not run.done:
                rows, started, ended, cpu = await self.worker.run(_timed, proposer.step, run)
                if rows:
                    self.metrics.batch_size.labels("round").observe(rows)  # this forward's sessions
                busy += ended - started
                self.metrics.draft_busy.inc(ended - started)
                self.metrics.draft_cpu.inc(cpu)
                for key, (fut, at) in waiting.items():  # the joiners began with this forward
                    if not at:
                        waiting[key] = (fut, started)
                if served := self._hand_out(run, waiting, ended):
                    self.capacity.observe_batch(busy, served)
                    busy = 0.0
                if not run.done:
                    await self._join(proposer, run, waiting)
        except Exception as exc:  # every session of the batch goes on without drafts (rounds.py)
            log.exception("batched drafting failed", sessions=len(waiting))
            for fut, _ in waiting.values():
                if not fut.done():
                    fut.set_exception(exc)
        finally:
            if run is not None and not run.done:
                self.worker.submit(proposer.abandon, run)  # after a forward still running, if any
            for fut, _ in waiting.values():
                fut.cancel()  # a no-op for those done

    async def _join(self, proposer: SteppingProposer, run: DraftRun, waiting: Waiting) -> None:
        """Let the verdicts that came during the forward in, and their sessions' rounds join ``run``."""
        await let_io_in(handoffs=1)
        joining = self._take_rounds(self.max_batch - len(run.live))
        if not joining:
            return
        now = time.perf_counter()
        for job, queued, fut in joining:
            self.metrics.job_wait.observe(now - queued)
            waiting[id(job)] = (fut, 0.0)
        await self.worker.run(proposer.join, run, [job for job, _, _ in joining])
        self._hand_out(run, waiting, time.perf_counter())  # the joiners that draft nothing

    def _hand_out(self, run: DraftRun, waiting: Waiting, ended: float) -> int:
        """Give each job that finished its proposal, with when it began drafting and when it ended (after
        counting the rows the proposer took from other sessions: a session's next call may read them);
        how many drafted something."""
        self._count_shared()
        served = 0
        for job, proposal in run.take_finished():
            fut, started = waiting.pop(id(job))
            served += bool(proposal.token_ids)
            if not fut.done():
                fut.set_result((proposal, started or ended, ended))
        return served

    def _take_rounds(self, room: int) -> list[Ready]:
        """Up to ``room`` ready rounds, oldest first; none while a lookahead waits. Lookaheads never join
        (they only fill idle time), so a run stops taking rounds and ends within a round's forwards once
        one waits: a session may be waiting for its lookahead to settle before its next round."""
        self._ready = [item for item in self._ready if not item[2].done()]
        if any(item[0].after.assume for item in self._ready):
            return []
        rounds = self._ready[: max(0, room)]
        self._ready = self._ready[len(rounds):]
        return rounds

    def _count_shared(self) -> None:
        """Count the prompt rows the proposer took from other sessions (a draft-model proposer's
        running ``shared_prefix_tokens``; model-free proposers have none), and its looked-up rows."""
        shared = int(getattr(self.proposer, "shared_prefix_tokens", 0))
        if shared > self._shared_seen:
            self.metrics.shared_prefix.inc(shared - self._shared_seen)
            self._shared_seen = shared
        fed, kept = int(getattr(self.proposer, "looked_up", 0)), int(getattr(self.proposer, "looked_up_kept", 0))
        if (fed, kept) != self._looked_up_seen:
            was_fed, was_kept = self._looked_up_seen
            self.metrics.looked_up.labels("kept").inc(kept - was_kept)
            self.metrics.looked_up.labels("dropped").inc((fed - kept) - (was_fed - was_kept))
            self._looked_up_seen = (fed, kept)


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float, float, float]:
    """Run ``fn`` (on the compute worker) and say when it started and ended, and the CPU seconds
    its thread spent on it (less than the wall time when other work shares the core)."""
    started, cpu = time.perf_counter(), time.thread_time()
    result = fn(*args)
    return result, started, time.perf_counter(), time.thread_time() - cpu
