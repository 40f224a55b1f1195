"""Prometheus metrics of one verifier: where each round's time goes, and the KV cache.

Served at ``GET /metrics`` on the verifier's port. The step histograms split a step into
``schedule`` (admission and batch choice), ``forward`` (the model), ``accept`` (the acceptance
maths, commits and next budgets) and ``total``; ``step_period`` is the time between the starts
of back-to-back steps, which also counts the event loop's share of the CPU. ``publish`` is the
event loop's time to turn one step's results into frames. ``queue_wait`` is how long a ready
round waited for a step; ``draft_wait`` how long the verifier waited for a drafter's draft
(drafting plus both network legs). ``process_cpu_seconds_total`` is the process's CPU time and
``forward_cpu_seconds`` the CPU time of the forwards alone, so their ratio is the machinery's
overhead whether or not the verifier idles, and whatever the host steals from a virtual CPU.
``python -m bench profile`` prints these side by side.

The policies' own gauges: per drafter its sessions' mean α̂, summed goodput X and draft
budget S (GoodSpeed's eq. 3 and 4, whatever the allocation policy), and accepted tokens;
the draft budget each speculating round hands on (its share at 0: rounds with speculation off,
by SmartSpec or a drafter's pause) and how many rounds changed it;
``utility`` is Σ log X over live sessions; per SLO class the finished requests that attained
or violated it; the time of each allocation and batch decision; and the step-time
estimator's error on each step before that step refines it (held-out by construction).
``fill_wait`` and ``fill_wait_deviation``: per drafter, the plain drafts' waits the fill policy
learns from and how far each was from the drafter's typical wait (their spread decides how close
to an expected draft the verifier dares to fill).

With ``--backend vllm``, vLLM's own metrics (``vllm:*``: its scheduler, KV cache usage,
speculative acceptance) are served beside these; the step histograms then stay empty, since
vLLM runs the steps.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.metrics_core import Metric

from services.verifier.allocation.tracker import GoodputTracker
from services.verifier.core_api import KVStats
from services.verifier.scheduler import Step

_P = "specfleet_verifier"
#: 50 us .. 2.5 s, finer where rounds live
_TIME = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
         0.25, 0.5, 1.0, 2.5)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_BUDGETS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16)
#: a gap longer than this between steps is idleness, not step time
MAX_PERIOD_S = 0.5


class VerifierMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total: the verifier's whole CPU use
        self.step = Histogram(f"{_P}_step_seconds", "Engine step time by phase", ["phase"], buckets=_TIME, registry=r)
        self.step_period = Histogram(f"{_P}_step_period_seconds", "Start-to-start time of back-to-back steps",
                                     buckets=_TIME, registry=r)
        self.queue_wait = Histogram(f"{_P}_queue_wait_seconds", "Ready round -> its step starts", buckets=_TIME,
                                    registry=r)
        self.draft_wait = Histogram(f"{_P}_draft_wait_seconds", "Verdict out -> next draft in (drafting + network)",
                                    buckets=_TIME, registry=r)
        self.publish = Histogram(f"{_P}_publish_seconds", "Event loop: one step's results -> frames queued",
                                 buckets=_TIME, registry=r)
        self.batch_sessions = Histogram(f"{_P}_batch_sessions", "Sessions per step", buckets=_SIZES, registry=r)
        self.batch_tokens = Histogram(f"{_P}_batch_tokens", "Tokens fed per step", buckets=_SIZES, registry=r)
        self.forward_cpu = Counter(f"{_P}_forward_cpu_seconds", "CPU time of the forward passes (the model alone)",
                                   registry=r)
        self.steps = Counter(f"{_P}_steps", "Engine steps", registry=r)
        self.rounds = Counter(f"{_P}_rounds", "Verified rounds", registry=r)
        self.raced_bonus = Counter(f"{_P}_raced_bonus_tokens",
                                   "Tokens after a fully accepted draft drawn by the keyed race the drafter "
                                   "guesses to draft ahead at temperature > 0 (shared.coupling)", registry=r)
        self.prefill_tokens = Counter(f"{_P}_prefill_tokens", "Prompt tokens cached", registry=r)
        self.shared_tokens = Counter(f"{_P}_shared_prefix_tokens",
                                     "Prompt tokens copied from another live request's KV instead of computed",
                                     registry=r)
        self.drafted = Counter(f"{_P}_drafted_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter(f"{_P}_accepted_tokens", "Draft tokens accepted", registry=r)
        self.generated = Counter(f"{_P}_generated_tokens", "Tokens committed", registry=r)
        self.conditional = Counter(f"{_P}_conditional_drafts", "Drafts sent before the Verdict they assume "
                                                                "(Draft.after), by whether that Verdict came true",
                                   ["outcome"], registry=r)
        self.filled = Counter(f"{_P}_filled_tokens", "Tokens decoded target-only for sessions whose drafts were on "
                                                     "their way, by steps with nothing to verify (fill)", registry=r)
        self.fill_wait = Histogram(f"{_P}_fill_wait_seconds", "Plain drafts' waits the fill policy learns from, "
                                                              "per drafter", ["drafter"], buckets=_TIME, registry=r)
        self.fill_wait_deviation = Counter(f"{_P}_fill_wait_deviation_seconds", "Σ |a plain draft's wait − its "
                                           "drafter's typical wait before it| (the fill policy's deviation)",
                                           ["drafter"], registry=r)
        self.kv_budget = Gauge(f"{_P}_kv_budget_bytes", "KV arena size", registry=r)
        self.kv_reserved = Gauge(f"{_P}_kv_reserved_bytes", "KV bytes reserved by admitted sessions", registry=r)
        self.kv_cached = Gauge(f"{_P}_kv_cached_tokens", "Tokens whose keys/values are cached", registry=r)
        self.sessions = Gauge(f"{_P}_sessions", "Sessions holding KV memory", registry=r)
        self.waiting = Gauge(f"{_P}_waiting_sessions", "Sessions waiting for KV memory", registry=r)
        self._policy_metrics(r)
        self._totals = dict.fromkeys(("steps", "decode_segments", "decode_tokens", "decode_cached", "step_seconds",
                                      "generated", "drafted", "accepted"), 0.0)
        self._by_drafter: dict[str, tuple[float, float]] = {}

    def _policy_metrics(self, r: CollectorRegistry) -> None:
        self.allocation_time = Histogram(f"{_P}_allocation_seconds", "One draft-length allocation decision",
                                         buckets=_TIME, registry=r)
        self.batch_decision = Histogram(f"{_P}_batch_decision_seconds", "One batch selection (and trim) decision",
                                        buckets=_TIME, registry=r)
        self.drafter_alpha = Gauge(f"{_P}_drafter_alpha", "Mean smoothed acceptance α̂ of a drafter's sessions",
                                   ["drafter"], registry=r)
        self.drafter_goodput = Gauge(f"{_P}_drafter_goodput", "Summed smoothed goodput X (tokens/round)",
                                     ["drafter"], registry=r)
        self.drafter_budget = Gauge(f"{_P}_drafter_budget", "Summed draft budget S of a drafter's sessions",
                                    ["drafter"], registry=r)
        self.drafter_accepted = Counter(f"{_P}_drafter_accepted_tokens", "Draft tokens accepted, per drafter",
                                        ["drafter"], registry=r)
        self.drafter_drafted = Counter(f"{_P}_drafter_drafted_tokens", "Draft tokens verified, per drafter",
                                       ["drafter"], registry=r)
        self.utility = Gauge(f"{_P}_utility", "GoodSpeed utility: sum of log X over live sessions", registry=r)
        self.slo = Counter(f"{_P}_slo_requests", "Finished requests per SLO class (tokens/s) and outcome",
                           ["slo_class", "outcome"], registry=r)
        self.estimate_error = Histogram(f"{_P}_step_estimate_error_ratio",
                                        "|predicted - measured| / measured forward time, before refining",
                                        buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0), registry=r)
        self.policy = Gauge(f"{_P}_policy_info", "The policies this verifier runs (value 1)",
                            ["allocation", "batching", "trim"], registry=r)
        self.draft_budget = Histogram(f"{_P}_draft_budget_tokens", "Draft budget each verified round of a "
                                      "speculating session gives its next round (0: that round decodes target-only)",
                                      buckets=_BUDGETS, registry=r)
        self.budget_changes = Counter(f"{_P}_draft_budget_changes", "Speculating rounds whose next budget differs "
                                      "from the one before (a drafter's lookahead for the old length is lost)",
                                      registry=r)
        self.trimmed = Counter(f"{_P}_trimmed_tokens", "Draft tokens dropped by the trim policy", registry=r)

    def observe_step(self, step: Step, scheduled: float, start: float, forward_end: float, end: float,
                     previous_start: float, forward_cpu: float) -> None:
        """Times of one step: schedule from ``scheduled``, forward from ``start``, then accept."""
        self.forward_cpu.inc(forward_cpu)
        self.step.labels("schedule").observe(start - scheduled)
        self.step.labels("forward").observe(forward_end - start)
        self.step.labels("accept").observe(end - forward_end)
        self.step.labels("total").observe(end - scheduled)
        if 0 < start - previous_start < MAX_PERIOD_S:
            self.step_period.observe(start - previous_start)
        self.steps.inc()
        t = self._totals
        t["steps"] += 1
        decoding = len(step.verify) + len(step.fill)  # their segments come first, prefill's after
        t["decode_segments"] += decoding
        t["decode_tokens"] += step.verify_tokens
        t["decode_cached"] += sum(shape.cached for shape in step.shapes[:decoding])
        t["step_seconds"] += end - scheduled
        self.batch_sessions.observe(len(step.segments))
        self.batch_tokens.observe(step.verify_tokens + step.prefill_tokens)
        self.prefill_tokens.inc(step.prefill_tokens)

    def count_budget(self, budget: int, before: int) -> None:
        """A speculating session's next draft budget, and whether it changed."""
        self.draft_budget.observe(budget)
        if budget != before:
            self.budget_changes.inc()

    @property
    def generated_total(self) -> int:
        """Tokens committed since the start, rounds and fills alike."""
        return int(self._totals["generated"])

    def count_generated(self, committed: int) -> None:
        """Tokens committed outside a verified round (a fill: decoded while the session's draft travelled)."""
        self._totals["generated"] += committed
        self.generated.inc(committed)

    def count_round(self, drafted: int, accepted: int, committed: int) -> None:
        t = self._totals
        t["generated"] += committed
        t["drafted"] += drafted
        t["accepted"] += accepted
        self.rounds.inc()
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        self.generated.inc(committed)

    def set_kv(self, kv: KVStats) -> None:
        self.kv_budget.set(kv.budget_bytes)
        self.kv_reserved.set(kv.reserved_bytes)
        self.kv_cached.set(kv.cached_tokens)
        self.sessions.set(kv.sessions)
        self.waiting.set(kv.waiting)

    def set_policies(self, allocation: str, batching: str, trim: str) -> None:
        self.policy.labels(allocation, batching, trim).set(1)

    def observe_allocation(self, tracker: GoodputTracker) -> None:
        self.utility.set(tracker.sum_log_x())
        for name, s in tracker.by_drafter().items():
            self.drafter_alpha.labels(name).set(s.alpha)
            self.drafter_goodput.labels(name).set(s.goodput)
            self.drafter_budget.labels(name).set(s.budget)

    def observe_fill_wait(self, drafter: str, wait_s: float, off_s: float | None) -> None:
        """A plain draft's wait, and how far it was from its drafter's typical one (None: its first)."""
        self.fill_wait.labels(drafter).observe(wait_s)
        if off_s is not None:
            self.fill_wait_deviation.labels(drafter).inc(off_s)

    def count_drafter(self, drafter: str, drafted: int, accepted: int) -> None:
        if drafter:
            self.drafter_drafted.labels(drafter).inc(drafted)
            self.drafter_accepted.labels(drafter).inc(accepted)
            before = self._by_drafter.get(drafter, (0.0, 0.0))
            self._by_drafter[drafter] = (before[0] + drafted, before[1] + accepted)

    def totals(self) -> dict[str, float]:
        """Cumulative counts since start, for the fleet view (``fleet_view``): a reader turns two
        readings into rates. Kept as plain numbers beside the Prometheus families, so a reading costs
        nothing however many drafters there are. Decode segments and tokens leave prefill out; the
        step seconds stay 0 under vLLM, which runs its own steps."""
        return dict(self._totals)

    def drafter_connected(self, drafter: str) -> None:
        """A drafter (re)connected: its fleet-view totals count from zero again, so a reader's rate
        over a window it connected in is its own (the Prometheus counters keep their lifetime sums)."""
        self._by_drafter.pop(drafter, None)

    def drafter_totals(self, drafter: str) -> tuple[float, float]:
        """(drafted, accepted) tokens of one drafter since it connected."""
        drafted, accepted = self._by_drafter.get(drafter, (0.0, 0.0))
        return drafted, accepted

    def count_slo(self, slo_tokens_per_s: float | None, met: bool) -> None:
        label = "none" if slo_tokens_per_s is None else f"{slo_tokens_per_s:g}"
        self.slo.labels(label, "attained" if met else "violated").inc()

    def observe_estimate(self, predicted_s: float, measured_s: float) -> None:
        if measured_s > 0:
            self.estimate_error.observe(abs(predicted_s - measured_s) / measured_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def include_vllm(self) -> None:
        """Serve vLLM's metrics (registered by its engine in the default registry) beside ours."""
        self.registry.register(_VllmMetrics())


class _VllmMetrics:
    """The ``vllm:*`` families of prometheus_client's default registry (only those: the rest
    would repeat our own process metrics)."""

    def collect(self) -> Iterator[Metric]:
        for family in REGISTRY.collect():
            if family.name.startswith("vllm:"):
                yield family
