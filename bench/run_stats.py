"""Every run's metrics, computed one way for every scenario (``summary``).

From the client's outcomes and the services' /metrics deltas of one :class:`bench.fleets.Run`:

* goodput: committed tokens per second, in all and per drafter (a drafter's rounds plus its
  accepted drafts: each round commits its accepted drafts and one token of the target's);
* acceptance (accepted / drafted), mean accepted length per round, wasted drafted tokens
  (drafted, not accepted) and verifier forward passes per committed token;
* TTFT and TPOT percentiles; SLO attainment per class, the verifier's counters (from the session's
  arrival at the verifier) and the client's (``slo_client``: from sending the request to its last token);
* fairness across drafters: Σ log x_i and Jain's index (Σx)² / (n·Σx²) of the per-drafter goodputs;
* the scheduler's decision time per step (batch selection and trim, and the allocation);
* the round breakdown: the drafters' mean seconds per phase of a round;
* for the simulator's validation: the costs the services measured (``measured_costs``), and a
  closed loop's first sends per repeat (``first_sends_ms_runs``: its sockets connect inside the
  run, so its first requests leave over tens of milliseconds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bench.client import Outcome, percentiles
from bench.scrape import Snapshot

if TYPE_CHECKING:
    from bench.fleets import Run

V, D, C = "specfleet_verifier", "specfleet_drafter", "specfleet_coordinator"
PHASES = ("worker_wait", "draft", "send", "verify_wait", "round")


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one takes everything (nan for none)."""
    if not values:
        return float("nan")
    square_sum = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square_sum) if square_sum > 0 else 1.0


def sum_log(values: Sequence[float]) -> float:
    """Σ log x_i, GoodSpeed's proportional-fairness utility (a drafter that got nothing counts as
    1e-9, so starving one costs about −20.7 instead of making the sum −inf)."""
    return sum(math.log(max(v, 1e-9)) for v in values)


def per_drafter_goodput(run: Run) -> dict[str, float]:
    """Committed tokens per second for each drafter's sessions over the run's measured time: all of
    them, drafted rounds, rounds the verifier ran target-only (budget 0) and fills, as its drafter
    counted them (``committed_tokens``); from a drafter that does not count them, its drafted rounds'
    (one token a round, plus the accepted drafts), which leaves the others out."""
    seconds = sum(run.walls)
    out = {}
    for name, snap in sorted(run.metrics.items()):
        if name.startswith("drafter") and seconds > 0:
            committed = snap.value(f"{D}_committed_tokens_total") or \
                snap.value(f"{D}_rounds_total") + snap.value(f"{D}_accepted_tokens_total")
            out[name] = committed / seconds
    return out


def per_drafter_drafts(run: Run) -> dict[str, dict[str, float]]:
    """Each drafter's acceptance (accepted over drafted tokens) and share of all drafted tokens
    (under a shared budget, where the budget went)."""
    drafted = {name: snap.value(f"{D}_drafted_tokens_total") for name, snap in sorted(run.metrics.items())
               if name.startswith("drafter")}
    total = sum(drafted.values())
    return {name: {"acceptance": run.metrics[name].value(f"{D}_accepted_tokens_total") / n if n else 0.0,
                   "draft_share": n / total if total else 0.0} for name, n in drafted.items()}


def slo_by_class(verifier: Snapshot) -> dict[str, dict[str, float]]:
    """Per SLO class (tokens/s, or "none"): finished requests and the share that met the class."""
    counts: dict[str, dict[str, float]] = {}
    for (name, labels), value in verifier.items():
        if name == f"{V}_slo_requests_total":
            tags = dict(labels)
            counts.setdefault(tags["slo_class"], {"attained": 0.0, "violated": 0.0})[tags["outcome"]] += value
    return {cls: {"requests": c["attained"] + c["violated"],
                  "attainment": c["attained"] / (c["attained"] + c["violated"]) if c["attained"] + c["violated"]
                  else float("nan")} for cls, c in sorted(counts.items())}


def drafter_snapshots(run: Run) -> list[Snapshot]:
    """Every drafter's metrics over the run."""
    return [s for name, s in run.metrics.items() if name.startswith("drafter")]


def round_breakdown(run: Run) -> dict[str, float]:
    """Mean milliseconds per round phase over every drafter of the run."""
    snaps = drafter_snapshots(run)
    out = {}
    for phase in PHASES:
        n = sum(s.count(f"{D}_round_phase_seconds", phase=phase) for s in snaps)
        total = sum(s.value(f"{D}_round_phase_seconds_sum", phase=phase) for s in snaps)
        out[phase] = total / n * 1e3 if n else 0.0
    return out


def summary(run: Run) -> dict[str, Any]:
    """The metrics every scenario reports for one run (see the module docstring)."""
    v = run.metrics.get("verifier", Snapshot())
    drafted = sum(o.drafted for o in run.outcomes)
    accepted = sum(o.accepted for o in run.outcomes)
    committed = sum(o.tokens for o in run.outcomes)
    rounds = v.value(f"{V}_rounds_total")
    steps = v.value(f"{V}_steps_total")
    drafters = per_drafter_goodput(run)
    return {
        "goodput_tok_s": run.tokens_per_s, "goodput_by_drafter": drafters, "drafts_by_drafter": per_drafter_drafts(run),
        "acceptance": accepted / drafted if drafted else 0.0,
        "mean_accepted_per_round": v.value(f"{V}_accepted_tokens_total") / rounds if rounds else 0.0,
        "wasted_drafted": drafted - accepted, "passes_per_token": steps / committed if committed else 0.0,
        "latency_s_mean": sum(o.latency_s for o in run.outcomes) / len(run.outcomes) if run.outcomes else 0.0,
        "ttft_ms": percentiles([o.ttft_s * 1e3 for o in run.outcomes]),
        "tpot_ms": percentiles([o.tpot_s * 1e3 for o in run.outcomes if o.tokens > 1]),
        "slo": slo_by_class(v),
        "slo_client": client_slo_by_class(run.outcomes),
        "sum_log_x": sum_log(list(drafters.values())) if drafters else float("nan"),
        "jain": jain(list(drafters.values())),
        "decision_ms": {"batch": v.mean(f"{V}_batch_decision_seconds") * 1e3,
                        "allocation": v.mean(f"{V}_allocation_seconds") * 1e3},
        "round_ms": round_breakdown(run),
        "costs": measured_costs(run),
        "drafted_share": drafted_share(run.metrics.get("coordinator", Snapshot())),
        "first_sends_ms_runs": [[round(t * 1e3, 2) for t in sends] for sends in run.first_sends],
    }


def drafted_share(coordinator: Snapshot) -> float:
    """The share of requests the coordinator queued for a drafter (the rest went target-only:
    ``--speculation auto`` while the verifier's policy wanted no drafts); NaN before any."""
    drafter = coordinator.value(f"{C}_routed_total", path="drafter")
    total = drafter + coordinator.value(f"{C}_routed_total", path="target_only")
    return drafter / total if total else float("nan")


def client_slo_by_class(outcomes: Sequence[Outcome]) -> dict[str, dict[str, float]]:
    """Per SLO class (``f"{tokens/s:g}"``): requests and the share that met it end to end, from
    the client's clock (:attr:`Outcome.slo_met`: a request queued before the verifier saw it
    counts its wait, which the verifier's own count cannot)."""
    out: dict[str, dict[str, float]] = {}
    for o in outcomes:
        if o.slo_tokens_per_s is not None:
            c = out.setdefault(f"{o.slo_tokens_per_s:g}", {"requests": 0.0, "attainment": 0.0})
            c["requests"] += 1
            c["attainment"] += o.slo_met
    for c in out.values():
        c["attainment"] /= c["requests"]
    return out


def measured_costs(run: Run) -> dict[str, Any]:
    """What the simulator's cost models are fitted from (``bench.sim.validate``): the verifier's
    mean forward, step period, queue wait (draft in to its step) and publishing (step results
    to frames), sessions (and their spread) and tokens per step, the prompt tokens it computed
    and those it copied from another request's shared prefix, the draft model's time per token
    its rounds drafted themselves (not taken from a lookahead; lookaheads apart) and rounds'
    drafts (over every drafter, and per drafter in ``by_drafter``), and where the CPU went
    (``cpu``)."""
    v = run.metrics.get("verifier", Snapshot())
    snaps = drafter_snapshots(run)
    rounds = sum(s.value(f"{D}_rounds_total") for s in snaps)
    drafted = sum(s.value(f"{D}_drafted_tokens_total") for s in snaps)
    busy, round_tokens = sum(round_busy(s) for s in snaps), sum(round_drafted(s) for s in snaps)
    return {"forward_ms": v.mean(f"{V}_step_seconds", phase="forward") * 1e3,
            "step_ms": v.mean(f"{V}_step_seconds", phase="total") * 1e3,
            "step_period_ms": v.mean(f"{V}_step_period_seconds") * 1e3,
            "queue_wait_ms": v.mean(f"{V}_queue_wait_seconds") * 1e3,
            "publish_ms": v.mean(f"{V}_publish_seconds") * 1e3,
            "batch_sessions": v.mean(f"{V}_batch_sessions"),
            "batch_tokens": v.mean(f"{V}_batch_tokens"),
            "batch_sessions_buckets": buckets(v, f"{V}_batch_sessions", unit=1.0),
            "prefill_tokens": v.value(f"{V}_prefill_tokens_total"),
            "shared_prefix_tokens": v.value(f"{V}_shared_prefix_tokens_total"),
            "draft_ms_per_token": busy / round_tokens * 1e3 if round_tokens else 0.0,
            "drafted_per_round": drafted / rounds if rounds else 0.0,
            "by_drafter": {name: drafter_costs(s) for name, s in sorted(run.metrics.items())
                           if name.startswith("drafter")},
            "fill_waits": fill_waits(v),
            "cpu": cpu_split(run)}


def fill_waits(v: Snapshot) -> dict[str, dict[str, float]]:
    """Per drafter (the verifier's name for it), the plain drafts' waits the fill policy learned
    from: how many, their mean and their mean deviation from the typical wait before each (ms)."""
    out: dict[str, dict[str, float]] = {}
    for name, labels in v:
        if name == f"{V}_fill_wait_seconds_count" and (n := v[(name, labels)]) > 0:
            drafter = dict(labels)["drafter"]
            off_s = v.value(f"{V}_fill_wait_deviation_seconds_total", drafter=drafter)
            out[drafter] = {"n": n, "mean_ms": v.mean(f"{V}_fill_wait_seconds", drafter=drafter) * 1e3,
                            "deviation_ms": off_s / n * 1e3}
    return dict(sorted(out.items()))


def cpu_split(run: Run) -> dict[str, float]:
    """Where the run's CPU went, in seconds over its measured window (``wall_s``): each service's
    process CPU and the load client's; the verifier's steps (``verifier_steps_s``: the wall time
    of its steps, each on its one core, so its CPU beyond them is its event loop's), session
    rounds and tokens filled (each a session-step of its own); the draft models' busy time
    (lookaheads included, and apart)."""
    v = run.metrics.get("verifier", Snapshot())
    out = {f"{name}_s": snap.value("process_cpu_seconds_total") for name, snap in sorted(run.metrics.items())}
    drafters = drafter_snapshots(run)
    return {**out, "client_s": run.client_cpu_s, "wall_s": sum(run.walls),
            "verifier_steps_s": v.value(f"{V}_step_seconds_sum", phase="total"),
            "verifier_rounds": v.value(f"{V}_rounds_total"),
            "verifier_filled": v.value(f"{V}_filled_tokens_total"),
            "draft_busy_s": sum(s.value(f"{D}_model_busy_seconds_total") for s in drafters),
            "lookahead_busy_s": sum(s.value(f"{D}_lookahead_busy_seconds_total") for s in drafters)}


def drafter_costs(snap: Snapshot) -> dict[str, Any]:
    """One drafter's draft-model milliseconds per token its rounds drafted themselves (not taken
    from a lookahead); drafted (and of them so drafted), accepted and asked-for tokens per round
    (a model-free proposer drafts fewer than asked); its rounds; draft-model busy seconds and
    their CPU seconds (lookaheads included, and apart); its lookaheads
    (how many were used, and of those how many the verifier held already as a conditional draft);
    the mean sessions its round batches drafted together (lookahead batches apart); its rounds'
    mean hand-off and send and wait for the verdict; and how its rounds' draft, send and
    verify_wait phases spread (``phase_buckets_ms``; its process CPU is in ``cpu_split``)."""
    rounds, drafted = snap.value(f"{D}_rounds_total"), snap.value(f"{D}_drafted_tokens_total")
    round_tokens = round_drafted(snap)
    return {"draft_ms_per_token": round_busy(snap) / round_tokens * 1e3 if round_tokens else 0.0,
            "drafted_per_round": drafted / rounds if rounds else 0.0,
            "round_drafted_per_round": round_tokens / rounds if rounds else 0.0,
            "accepted_per_round": snap.value(f"{D}_accepted_tokens_total") / rounds if rounds else 0.0,
            "asked_per_round": snap.value(f"{D}_asked_tokens_total") / rounds if rounds else 0.0,
            "rounds": rounds, "model_busy_s": snap.value(f"{D}_model_busy_seconds_total"),
            "lookahead_busy_s": snap.value(f"{D}_lookahead_busy_seconds_total"),
            "model_cpu_s": snap.value(f"{D}_model_cpu_seconds_total"),
            "lookahead_cpu_s": snap.value(f"{D}_lookahead_cpu_seconds_total"),
            "lookaheads": sum(snap.value(f"{D}_lookaheads_total", outcome=o) for o in ("used", "missed", "dropped")),
            "lookaheads_used": snap.value(f"{D}_lookaheads_total", outcome="used"),
            "presented": snap.value(f"{D}_presented_lookaheads_total"),
            "batch_sessions": snap.mean(f"{D}_draft_batch_sessions", kind="round"),
            "send_ms": snap.mean(f"{D}_round_phase_seconds", phase="send") * 1e3,
            "verify_wait_ms": snap.mean(f"{D}_round_phase_seconds", phase="verify_wait") * 1e3,
            "phase_buckets_ms": {phase: buckets(snap, f"{D}_round_phase_seconds", phase=phase)
                                 for phase in ("draft", "send", "verify_wait")}}


def buckets(snap: Snapshot, histogram: str, unit: float = 1e3, **labels: str) -> list[list[float]]:
    """A histogram's observations per bucket: ``[upper bound × unit, count]`` in increasing order
    (not cumulative; the last bound may be inf), by default seconds as ms, for the simulator's
    spreads (``bench.sim.spread``)."""
    want = set(labels.items())
    cumulative = sorted((float(dict(key)["le"]), v) for (name, key), v in snap.items()
                        if name == f"{histogram}_bucket" and want <= set(key))
    out, before = [], 0.0
    for le, total in cumulative:
        out.append([le * unit, total - before])
        before = total
    return out


def round_drafted(snap: Snapshot) -> float:
    """The draft tokens a drafter's rounds sent that its draft model drafted in them, not taken from
    a lookahead: what its round busy time (:func:`round_busy`) drafted. Runs before the drafters
    counted them: all the tokens its rounds sent (which overstates them when lookaheads were used)."""
    name = f"{D}_round_drafted_tokens_total"
    return snap.value(name) if (name, ()) in snap else snap.value(f"{D}_drafted_tokens_total")


def round_draft_ms_per_token(d: dict[str, Any]) -> float:
    """A drafter's draft-model ms per token its rounds drafted (``drafter_costs``). A results file
    from before the drafters counted those tokens (no ``round_drafted_per_round``) divided by every
    token its rounds sent, when a round that took its lookahead drafted none: that one is scaled by
    its rounds over those that took none, taking a used lookahead's draft as long as a round's (so
    the fairness run of 2026-11-27 18:55, where 272 of drafter-1's 539 rounds took a lookahead,
    gave 1.25 ms where its drafting rounds took about 2.5 ms a token)."""
    rounds, used = d.get("rounds", 0.0), d.get("lookaheads_used", 0.0)
    if "round_drafted_per_round" in d or not rounds > used:
        return float(d["draft_ms_per_token"])
    return float(d["draft_ms_per_token"]) * rounds / (rounds - used)


def round_busy(snap: Snapshot) -> float:
    """A drafter's draft-model seconds on its rounds: its busy time less its lookaheads'."""
    return snap.value(f"{D}_model_busy_seconds_total") - snap.value(f"{D}_lookahead_busy_seconds_total")
