"""What a simulation measures: :class:`Recorder` collects during the run, :class:`SimResult` is the outcome.

Every field of :class:`SimResult` is a function of the spec and its seed, except the wall-clock
ones (:data:`WALL_CLOCK_FIELDS`): the time this machine spent in the real policies' code
(``batcher.select`` + ``allocator.assign`` per verifier step, ``allocator.initial`` per admission)
and the run's own duration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from bench.run_stats import jain, sum_log

#: fields measured with time.perf_counter (not reproducible); the rest are deterministic for a seed
WALL_CLOCK_FIELDS = ("sched_ms_mean", "sched_ms_p99", "select_ms_mean", "assign_ms_mean", "admit_ms_mean",
                     "admit_ms_p99", "sched_share", "wall_s")


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _ms(values: Sequence[float], q: float | None = None) -> float:
    if not len(values):
        return 0.0
    return 1e3 * float(np.percentile(values, q) if q is not None else np.mean(values))


@dataclass(frozen=True)
class RequestRecord:
    drafter: int
    latency_s: float  # arrival at the client -> its last token back at the client
    ttft_s: float  # arrival -> first token back at the client
    tpot_s: float | None  # (last − first token) / (tokens − 1)
    slo_tokens_per_s: float | None
    slo_met: bool
    speculative: bool = True  # it had a drafter (False: opened target-only)


@dataclass
class Recorder:
    """Running totals of one simulation (see :meth:`result` for what they become)."""

    n_drafters: int
    steps: int = 0
    batch_sessions: int = 0
    step_seconds: float = 0.0
    rounds: int = 0
    drafted_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    asked: int = 0
    max_budget_sum: int = 0
    lookaheads: int = 0  # pipelined drafts started, per session
    lookaheads_used: int = 0  # of them, those that became the next round's draft
    conditional_sent: int = 0  # lookaheads sent to the verifier before their verdict
    conditional_taken: int = 0  # of them, those the verifier verified (their verdict came true)
    filled: int = 0  # tokens decoded by fill steps (while the sessions' drafts travelled)
    select_s: list[float] = field(default_factory=list)
    assign_s: list[float] = field(default_factory=list)
    admit_s: list[float] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)  # per drafter
    waits: list[list[float]] = field(default_factory=list)  # per drafter: Σ and count of verdict waits
    batches: list[list[int]] = field(default_factory=list)  # per drafter: round batches and their sessions
    #: per drafter: plain draft waits the fill policy learned from, their Σ, and Σ of their
    #: deviations from the typical wait before each
    fill_waits: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.committed = [0] * self.n_drafters
        self.waits = [[0.0, 0.0] for _ in range(self.n_drafters)]
        self.batches = [[0, 0] for _ in range(self.n_drafters)]
        self.fill_waits = [[0.0, 0.0, 0.0] for _ in range(self.n_drafters)]

    def fill_wait(self, drafter: int, wait_s: float, off_s: float | None) -> None:
        row = self.fill_waits[drafter]
        row[0] += 1
        row[1] += wait_s
        row[2] += off_s or 0.0

    def draft_batch(self, drafter: int, sessions: int) -> None:
        self.batches[drafter][0] += 1
        self.batches[drafter][1] += sessions

    def verdict_wait(self, drafter: int, seconds: float) -> None:
        """A session's draft left ``seconds`` ago and its drafter starts on the session's next round
        now (the real drafter's verify_wait and worker_wait phases)."""
        self.waits[drafter][0] += seconds
        self.waits[drafter][1] += 1

    def step(self, sessions: int, seconds: float, select_s: float, assign_s: float) -> None:
        self.steps += 1
        self.batch_sessions += sessions
        self.step_seconds += seconds
        self.select_s.append(select_s)
        self.assign_s.append(assign_s)

    def fill(self, drafter: int) -> None:
        """One token decoded for a session of ``drafter`` while its draft travelled."""
        self.filled += 1
        self.committed[drafter] += 1

    def round(self, drafter: int, drafted: int, accepted: int, committed: int, asked: int) -> None:
        self.rounds += 1
        self.asked += asked
        self.drafted += drafted
        self.accepted += accepted
        self.drafted_rounds += drafted > 0
        self.committed[drafter] += committed


@dataclass(frozen=True)
class SimResult:
    """The outcome of one simulation; rates are per simulated second, latencies in simulated seconds."""

    label: str  # e.g. "cpu N=100 fixed/fcfs/fixed"
    n_drafters: int
    cost: str
    allocation: str
    batching: str
    controller: str
    speculative: bool
    sim_s: float  # simulated time until the stop
    steps: int  # verifier forward passes
    rounds: int  # session-rounds verified
    committed: int  # tokens committed
    drafted: int
    accepted: int
    requests_done: int
    goodput_tok_s: float  # committed tokens per simulated second, all drafters
    per_drafter_tok_s: tuple[float, ...]
    latency_s: float | None  # mean over finished requests
    ttft_s: float | None
    tpot_s: float | None
    acceptance_rate: float | None  # accepted / drafted
    drafted_share: float | None  # finished requests that had a drafter, over all finished
    mean_accepted: float | None  # accepted drafts per round that had drafts
    rounds_per_token: float | None  # verifier passes (session-rounds) per committed token; 1 target-only
    steps_per_token: float | None  # forward passes per committed token
    mean_batch: float | None  # sessions per step
    mean_step_s: float | None  # simulated seconds per step
    jain: float  # over per-drafter goodputs
    sum_log_x: float  # Σ log of per-drafter goodputs (tokens/s)
    tracker_sum_log_x: float  # GoodSpeed's U = Σ log X_i over the live sessions at the end (tokens/round)
    slo_attainment: dict[str, float]  # SLO class (tokens/s) -> share of finished requests that met it
    max_budget_sum: int  # peak Σ draft budgets held by live sessions (≤ GoodSpeed's C when one is set)
    drafted_rounds: int  # rounds that carried drafts
    asked: int  # draft tokens the rounds asked their proposers for (≥ drafted: a proposer may run out)
    lookaheads: int  # pipelined drafts started, per session
    lookaheads_used: int  # of them, those that became the next round's draft
    conditional_sent: int  # lookaheads sent to the verifier as conditional drafts, before their verdict
    conditional_taken: int  # of them, those the verifier verified (their verdict came true)
    filled: int  # tokens decoded by fill steps, while the sessions' drafts travelled (in ``committed``)
    #: per drafter: the mean time from a draft leaving to the drafter starting on that session's next
    #: round (the real drafter's verify_wait + worker_wait: the verifier, both links, and waiting for
    #: its own draft model); None: no such round
    verdict_wait_s: tuple[float | None, ...]
    #: per drafter: the mean sessions its round batches drafted together (None: no batch)
    draft_batch_sessions: tuple[float | None, ...]
    #: per drafter: the mean plain draft wait the fill policy learned from, and the mean deviation
    #: from the typical wait before each (its spread; the real verifier's ``fill_wait`` metrics)
    fill_wait_s: tuple[float | None, ...]
    fill_wait_deviation_s: tuple[float | None, ...]
    sched_ms_mean: float  # wall clock in batcher.select + allocator.assign per step
    sched_ms_p99: float
    select_ms_mean: float
    assign_ms_mean: float
    admit_ms_mean: float  # wall clock in allocator.initial per admitted request
    admit_ms_p99: float
    sched_share: float  # Σ scheduling wall time / Σ simulated step time: what the policies would add
    wall_s: float  # the simulation's own wall-clock time

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["per_drafter_tok_s"] = list(self.per_drafter_tok_s)
        out["verdict_wait_s"] = list(self.verdict_wait_s)
        out["draft_batch_sessions"] = list(self.draft_batch_sessions)
        out["fill_wait_s"] = list(self.fill_wait_s)
        out["fill_wait_deviation_s"] = list(self.fill_wait_deviation_s)
        return out

    def deterministic(self) -> dict[str, Any]:
        """Every field but the wall-clock ones: equal for equal specs and seeds."""
        return {k: v for k, v in self.to_dict().items() if k not in WALL_CLOCK_FIELDS}


def slo_attainment(requests: Sequence[RequestRecord]) -> dict[str, float]:
    classes: dict[str, list[bool]] = {}
    for r in requests:
        if r.slo_tokens_per_s is not None and r.slo_tokens_per_s > 0:
            classes.setdefault(f"{r.slo_tokens_per_s:g}", []).append(r.slo_met)
    return {k: sum(v) / len(v) for k, v in sorted(classes.items())}


def summarise(rec: Recorder, sim_s: float, tracker_u: float, wall_s: float, **labels: Any) -> SimResult:
    """The :class:`SimResult` of a finished run (``labels``: label, n_drafters, cost, policies, speculative)."""
    span = max(sim_s, 1e-12)
    per = tuple(c / span for c in rec.committed)
    total = sum(rec.committed)
    sched = [a + b for a, b in zip(rec.select_s, rec.assign_s, strict=True)]
    tpots = [r.tpot_s for r in rec.requests if r.tpot_s is not None]
    return SimResult(
        sim_s=sim_s, steps=rec.steps, rounds=rec.rounds, committed=total, drafted=rec.drafted, accepted=rec.accepted,
        requests_done=len(rec.requests), goodput_tok_s=total / span, per_drafter_tok_s=per,
        latency_s=_mean([r.latency_s for r in rec.requests]), ttft_s=_mean([r.ttft_s for r in rec.requests]),
        tpot_s=_mean(tpots), acceptance_rate=rec.accepted / rec.drafted if rec.drafted else None,
        drafted_share=_mean([float(r.speculative) for r in rec.requests]),
        mean_accepted=rec.accepted / rec.drafted_rounds if rec.drafted_rounds else None,
        rounds_per_token=rec.rounds / total if total else None, steps_per_token=rec.steps / total if total else None,
        mean_batch=rec.batch_sessions / rec.steps if rec.steps else None,
        mean_step_s=rec.step_seconds / rec.steps if rec.steps else None,
        jain=jain(per), sum_log_x=sum_log(per), tracker_sum_log_x=tracker_u,
        slo_attainment=slo_attainment(rec.requests), max_budget_sum=rec.max_budget_sum,
        drafted_rounds=rec.drafted_rounds, asked=rec.asked, lookaheads=rec.lookaheads,
        lookaheads_used=rec.lookaheads_used, conditional_sent=rec.conditional_sent,
        conditional_taken=rec.conditional_taken, filled=rec.filled,
        verdict_wait_s=tuple(t / n if n else None for t, n in rec.waits),
        draft_batch_sessions=tuple(s / n if n else None for n, s in rec.batches),
        fill_wait_s=tuple(s / n if n else None for n, s, _ in rec.fill_waits),
        fill_wait_deviation_s=tuple(d / n if n else None for n, _, d in rec.fill_waits),
        sched_ms_mean=_ms(sched), sched_ms_p99=_ms(sched, 99), select_ms_mean=_ms(rec.select_s),
        assign_ms_mean=_ms(rec.assign_s), admit_ms_mean=_ms(rec.admit_s), admit_ms_p99=_ms(rec.admit_s, 99),
        sched_share=sum(sched) / rec.step_seconds if rec.step_seconds > 0 else 0.0, wall_s=wall_s, **labels)
