"""``python -m bench sim-validate``: the simulator against the real runs of the same scenarios.

For every row of the latest real results (``<results>/{capacity,load,fairness}.json``) it builds
the :class:`SimSpec` of the same scenario from what that run measured and what the machine's
profile says, simulates it, and compares goodput (committed tokens/s) and mean request latency:

* the verifier's step time: the profiled estimator (``--estimator-file``) scaled so that it
  gives the run's measured mean forward at the run's mean batch (``step_scale``: the real
  verifier refits its estimator online to the forwards it measures), plus the run's own
  measured step time beyond its forward (scheduling, judging: the ``total`` minus the
  ``forward`` phase) as a fixed per-step overhead, and its CPU outside its steps (its event
  loop) per session verified;
* each drafter's costs (per drafter where the run recorded them, else the run's pooled
  values): its draft-model seconds per token its rounds drafted themselves (not those that took
  a lookahead; lookaheads apart: ``round_draft_ms_per_token``), split into
  a forward's fixed cost and a cost per row at the sessions its batches held
  (``split_draft_cost``: a batch of many sessions costs less per session than one of few), its
  hand-off and send per round (a delay after its batch), its draft-model time per lookahead
  token, and its link time (``link_s``: the wait for its verdict beyond
  the verifier's own time on the round), which stands for the RTT when longer than the
  configured one; drafters pipeline as the real ones do by default;
* acceptance: the per-token α whose accepted prefix over the mean draft length gives the mean
  accepted tokens per round (per drafter, likewise); with the fixed controller, a drafter whose
  proposer drafted fewer tokens than its rounds asked for (the n-gram drafter, when its match runs
  out) also gets the proposal rate that explains the shortfall (``acceptance_of``);
* the workload: the same sessions, requests, output lengths, arrival times (the same seeded
  trace) and RTTs, and the prompts' length the verifier prefilled (``prompt_len_of``); a
  closed-loop run's requests come from one pool, as from the real queue, the first ones when the
  real client sent them (its sockets connect inside the run; ``first_sends_s``);
* a drafter's round batch hands its drafts off one after another, as the real session tasks send
  them in turn (``DrafterSpec.send_rows``, at the drafter's measured mean batch);
* the step scale uses the run's mean tokens per session-step where it recorded them (the real
  verifier's fill steps, one token each, among them), and the loop's CPU is spread over verified
  rounds and filled tokens; the simulated verifier fills too with ``--fill``, in steps with
  nothing to verify and as riders in steps that verify others, as the real one has by default
  since 2026-12-03 (for runs before that, which took no riders, the simulator filled more than
  they did, so it is off by default).

Two switches model this machine's shared edge core (both off by default):

* ``--spread``: each drafter's round batches and hand-offs take their mean times a draw from its
  rounds' measured draft and send phases (``spread.py``; the real ones range over several times
  their mean), so that its drafts arrive as unevenly as the real ones (the send phases' spread
  includes a batch's drafts leaving in turn, so they are drawn in place of ``send_rows``);
* ``--edge-cores C``: the drafters share C cores (processor sharing, ``edge_cpu.py``), their
  batches priced in their draft models' measured CPU seconds.

Older results files lack some of these (the CPU split, lookahead time, link time, the phases'
histograms, the draft models' CPU time); their rows are simulated without them.

Rows the simulator does not model are listed as skipped (the SLED-like baseline recomputes the
whole context, which the simulator's verifier does not). Writes ``<out>/<stem>.{json,md}``
(``--stem``, default ``sim-validation``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from bench.capacity import NO_FILL
from bench.fleets import write_results
from bench.run_stats import round_draft_ms_per_token
from bench.sim.costs import DEFAULT_PROFILE, CostSpec, load_cpu_coef
from bench.sim.engine import simulate
from bench.sim.result import SimResult
from bench.sim.spec import DrafterSpec, Policies, SimSpec, VerifierSpec
from bench.sim.spread import Spread
from bench.sim.validation_table import markdown
from bench.sim.workload import PROMPT_LEN, TARGET_ONLY, configured_rtt_ms, first_sends_s, prompt_len_of
from bench.traces import trace_arrivals
from services.verifier.batching.estimator import Coef, StepTimeEstimator

SOURCES = ("capacity", "load", "fairness")
TOLERANCE = 0.15
PIPELINE_SESSIONS = 2  # the real drafters' default --pipeline-sessions, which the benchmarks keep
#: a draft-model forward's fixed cost in rows' worth: draft-small's greedy batches on the edge core,
#: `python -m bench.costs --model models/draft-small --draft-batches 1,2,4,8,16 --prompt-len 12`
#: (2026-11-26: 4.36 and 4.84 in two runs; their mean)
DRAFT_FORWARD_ROWS = 4.6
DRAFTED_MS = 0.05  # a round's draft phase above this drafted (the drafters' first histogram bucket)


def alpha_for(accepted_per_round: float, drafted_per_round: float) -> float:
    """The per-token acceptance α with Σ_{j=1..k} α^j = accepted (k drafted per round), by bisection."""
    k = drafted_per_round
    if k <= 0 or accepted_per_round <= 0:
        return 0.0
    if accepted_per_round >= k:
        return 1.0

    def prefix(a: float) -> float:
        return a * (1 - a**k) / (1 - a) if a < 1 else k
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if prefix(mid) < accepted_per_round else (lo, mid)
    return (lo + hi) / 2


def policies_of(source: str, row: dict[str, Any], meta: dict[str, Any]) -> Policies | None:
    """The real policies the row's scenario ran (None: not one the simulator models)."""
    name, k = row["scenario"], int(row.get("draft_len", 4))
    if source == "fairness":
        capacity = int(meta.get("capacity", 12))
        return Policies(allocation=name, draft_len=max(1, capacity // len(meta["drafters"])), capacity=capacity)
    if name in TARGET_ONLY or name.startswith("fixed k="):
        return Policies(draft_len=int(name.split("=")[1]) if "=" in name else k)
    if name in ("specfleet", NO_FILL):
        return Policies(allocation="goodspeed", draft_len=k)
    if name == "smartspec":
        return Policies(allocation="smartspec", draft_len=k, smartspec_max_len=k)
    if name == "adaspec":
        return Policies(controller="adaspec", draft_len=k)
    return None


class DrafterCosts(NamedTuple):
    """What a real run measured of one drafter, as the simulator takes it."""

    alpha: float  # per-token acceptance
    token_s: float  # draft-model seconds per drafted token of its rounds
    send_s: float  # from its batch's end to a draft leaving: handing it off and sending it
    link_s: float  # a round's time between drafter and verifier beyond both (network, event loops)
    lookahead_token_s: float = 0.0  # draft-model seconds per lookahead token (0: not recorded)
    proposal_rate: float = 1.0  # the chance its proposer has each next draft token (DrafterSpec's)
    forward_s: float = 0.0  # draft-model fixed seconds per forward of a batch (DrafterSpec's)
    cpu_share: float = 1.0  # its draft model's CPU seconds per busy second (1: not recorded)
    draft_spread: Spread | None = None  # its rounds' measured draft phases, those that drafted (None: not recorded)
    send_spread: Spread | None = None  # its rounds' measured send phases
    send_rows: float = 0.0  # the mean sessions of its round batches, whose drafts leave in turn (0: not recorded)


class Knobs(NamedTuple):
    """How the validation builds its simulations (the CLI's switches)."""

    forward_rows: float = DRAFT_FORWARD_ROWS  # a draft-model forward's fixed cost in rows' worth
    fill: bool = False  # the simulated verifier fills while drafts travel
    jitter_s: float = 0.0  # every drafter's link jitter (DrafterSpec.jitter_s)
    #: the drafters share this many cores, as the real runs' pinned edge core (SimSpec.edge_cores):
    #: their costs become CPU seconds (the measured ones times ``cpu_share``) and the cores' other
    #: work the runs' edge CPU beyond the draft models (``edge_background``); 0: each its own
    edge_cores: float = 0.0
    #: each drafter's round batches and hand-offs spread as its rounds' measured draft and send
    #: phases did (DrafterSpec.draft_spread, send_spread; runs since 2026-11-27 04:15)
    spread: bool = False
    #: simulations per real repeat, with seeds 0, 1, …: a short row's simulated rate depends on its
    #: draws (the 8 requests of the 40 ms capacity run at 4 sessions: 230–276 tokens/s over 6 seeds)
    seeds: int = 1


DEFAULTS = Knobs()


def acceptance_of(d: dict[str, Any], whole_drafts: bool) -> tuple[float, float]:
    """A drafter's per-token acceptance α and proposal rate ρ from its rounds' mean drafted,
    accepted and asked-for tokens. With ``whole_drafts`` (the fixed controller: a round drafts all
    it asks for unless its proposer runs out), the proposer has each next token with probability ρ
    (so Σ_{j≤asked} ρ^j = drafted) and the first j are drafted and accepted with probability
    (ρα)^j; else (or when none fell short, or an older run did not count the ask) ρ = 1 and the
    controller's own stops, which the simulator runs, make the drafts shorter. Fitted at the mean
    ask: exact when every round asks for the same (Fixed-S); when budgets vary (Random-S,
    GoodSpeed) the concave Σ ρ^j makes ρ come out somewhat low."""
    drafted, accepted, asked = d["drafted_per_round"], d["accepted_per_round"], d.get("asked_per_round", 0.0)
    if not whole_drafts or asked <= drafted:
        return alpha_for(accepted, drafted), 1.0
    rate = alpha_for(drafted, asked)
    return (min(1.0, alpha_for(accepted, asked) / rate) if rate > 0 else 0.0), rate


def drafter_params(row: dict[str, Any], n: int, whole_drafts: bool = False,
                   forward_rows: float = DRAFT_FORWARD_ROWS) -> list[DrafterCosts]:
    """Each drafter's costs: its own measured rounds where the run recorded them per drafter
    (``costs.by_drafter``), else the run's pooled values for all of them (acceptance: see
    :func:`acceptance_of`; the draft model's cost per forward and per row: :func:`split_draft_cost`)."""
    c, phases, cpu = row["costs"], row.get("round_ms", {}), row["costs"].get("cpu", {})
    wall = cpu.get("wall_s", 0.0)

    def link(verify_wait_ms: float, busy_s: float, lookahead_busy_s: float = 0.0, token_s: float = 0.0) -> float:
        """``link_s`` with what holds this drafter's event loop up: its round batches (a verdict
        waits for the rest of one) and its lookahead tokens (for the rest of one token)."""
        if not wall:
            return link_s(c, verify_wait_ms)
        held = ((busy_s - lookahead_busy_s) * phases.get("draft", 0.0) + lookahead_busy_s * token_s * 1e3) / wall
        return link_s(c, verify_wait_ms, held)
    pooled = DrafterCosts(alpha_for(row["mean_accepted_per_round"], c["drafted_per_round"]),
                          c["draft_ms_per_token"] / 1e3, phases.get("send", 0.0) / 1e3,
                          link(phases.get("verify_wait", 0.0), cpu.get("draft_busy_s", 0.0) / n,
                               cpu.get("lookahead_busy_s", 0.0) / n))
    own = [d for _, d in sorted(c.get("by_drafter", {}).items())]
    if len(own) != n:
        return [pooled] * n

    def of(d: dict[str, Any]) -> DrafterCosts:
        alpha, rate = acceptance_of(d, whole_drafts)
        send_s = d["send_ms"] / 1e3 if "send_ms" in d else pooled.send_s
        ahead_s = lookahead_token_s(d)
        token_s = round_draft_ms_per_token(d) / 1e3
        row_s, forward_s = split_draft_cost(token_s, d.get("batch_sessions", 0.0), forward_rows)
        busy, cpu_s = d.get("model_busy_s", 0.0), d.get("model_cpu_s", 0.0)
        phases = d.get("phase_buckets_ms", {})
        return DrafterCosts(alpha, row_s, send_s,
                            link(d["verify_wait_ms"], busy, d.get("lookahead_busy_s", 0.0),
                                 ahead_s) if "verify_wait_ms" in d else pooled.link_s,
                            ahead_s, rate, forward_s, min(1.0, cpu_s / busy) if busy > 0 and cpu_s > 0 else 1.0,
                            # a round that drafted nothing (its lookahead was ready) has a draft phase of 0
                            Spread.of_buckets(phases.get("draft", []), above=DRAFTED_MS),
                            Spread.of_buckets(phases.get("send", [])), d.get("batch_sessions", 0.0))
    return [of(d) if d["drafted_per_round"] > 0 else pooled for d in own]


def split_draft_cost(token_s: float, rows: float, forward_rows: float) -> tuple[float, float]:
    """A drafter's measured draft-model seconds per drafted token, ``token_s``, at its batches'
    mean sessions ``rows`` (``batch_sessions``), as a cost per row and a fixed cost per forward
    worth ``forward_rows`` rows (the draft model's proportion, :data:`DRAFT_FORWARD_ROWS`): a
    forward over r rows takes forward_s + r·row_s, and at ``rows`` that is rows·token_s. Returns
    (row_s, forward_s); (token_s, 0), a cost proportional to the rows, for a run that did not
    record its batches. (The mean over batches stands for the mean over forwards: a batch runs as
    many forwards as its longest draft, and under a fixed budget its drafts are all alike.)"""
    if forward_rows <= 0 or rows <= 0:
        return token_s, 0.0
    row_s = token_s * rows / (forward_rows + rows)
    return row_s, forward_rows * row_s


def lookahead_token_s(d: dict[str, Any]) -> float:
    """A drafter's draft-model seconds per lookahead token: its lookaheads' time over their tokens,
    taken as what its rounds asked for (as a lookahead asks for as many as its round did; older
    runs: what they drafted) plus the guess each (a lookahead cut short by its verdict has fewer,
    so this errs low); 0 when the run did not count lookaheads."""
    if not d.get("lookaheads"):
        return 0.0
    return d["lookahead_busy_s"] / (d["lookaheads"] * ((d.get("asked_per_round") or d["drafted_per_round"]) + 1))


def link_s(costs: dict[str, Any], verify_wait_ms: float, drafter_held_ms: float = 0.0) -> float:
    """A round's seconds between the drafter and the verifier beyond both (0 for a run that did not
    record them): the network (the RTT), and each frame's wait for the event loop of a process
    that is busy with something else, on this machine's loopback several ms.

    It is the drafter's wait for its verdict less what the simulator models itself: the
    verifier's time on the round (its queue wait, its step, publishing the result), and the two
    waits of a frame that arrives while its receiver computes (with inline compute its event loop
    is blocked meanwhile): a draft arriving during a verifier step waits on average the rest of
    it, busy · step / 2 (the verifier's busy share of the window), and a verdict arriving while
    the drafter computes the rest of that computation, ``drafter_held_ms`` / 2 (Σ busy share ·
    length over what it computes: round batches, lookahead tokens). Only work for other sessions
    makes a session's frame wait (a session alone finds both ends idle when its frames come), so
    both are scaled by the share of a step's sessions that are others, 1 − 1/sessions."""
    if "queue_wait_ms" not in costs or verify_wait_ms <= 0:
        return 0.0
    cpu = costs.get("cpu", {})
    verifier_busy = cpu["verifier_steps_s"] / cpu["wall_s"] if cpu.get("wall_s") else 0.0
    others = 1.0 - 1.0 / max(1.0, costs.get("batch_sessions") or 1.0)
    inside = costs["queue_wait_ms"] + costs["step_ms"] + costs.get("publish_ms", 0.0)
    blocked = others * (verifier_busy * costs["step_ms"] + drafter_held_ms) / 2
    return max(0.0, verify_wait_ms - inside - blocked) / 1e3


def verifier_loop_s(cpu: dict[str, float]) -> float:
    """The verifier's CPU seconds per session-step outside its steps (its event loop: reading
    drafts, sending verdicts and tokens), from a run's CPU split (0 without one): over its verified
    rounds and the tokens it filled while drafts travelled (each streamed on its own)."""
    rounds = cpu.get("verifier_rounds", 0.0) + cpu.get("verifier_filled", 0.0)
    if rounds <= 0:
        return 0.0
    return max(0.0, cpu.get("verifier_s", 0.0) - cpu.get("verifier_steps_s", 0.0)) / rounds


def drafters_of(source: str, row: dict[str, Any], meta: dict[str, Any], repeat: int = 0,
                whole_drafts: bool = False, knobs: Knobs = DEFAULTS) -> tuple[DrafterSpec, ...]:
    """The clients and drafters of the row: its sessions, requests, arrivals (those of its
    ``repeat``-th repeat: the real run seeds repeat i with seed + i), RTTs and costs (in CPU
    seconds with ``knobs.edge_cores``). A drafter's RTT is its configured one (its own in a fairness
    run, else the edge network's, ``configured_rtt_ms``), or the measured link time of its rounds
    when that is longer; with a jitter J, J less (the jitter keeps its mean)."""
    n = max(1, len(row["goodput_by_drafter"]))
    requests = int(row.get("requests", 30))
    rtts = [float(rtt) / 1e3 for _, rtt in meta["drafters"]] if source == "fairness" else \
        [configured_rtt_ms(row) / 1e3] * n
    arrivals: list[float] = []
    if row.get("arrival_rate", 0) > 0:
        arrivals = trace_arrivals(row.get("trace", "poisson"), row["arrival_rate"], requests,
                                  int(row.get("seed", 0)) + repeat)
    sends = first_sends_s(row, repeat)
    base = DrafterSpec("d", round_s=0.0, prompt_len=meta.get("prompt_len", PROMPT_LEN),
                       max_tokens=int(row.get("max_tokens", 128)), pipeline_sessions=PIPELINE_SESSIONS)
    specs = []
    for i, d in enumerate(drafter_params(row, n, whole_drafts, knobs.forward_rows)):
        cpu = d.cpu_share if knobs.edge_cores else 1.0
        specs.append(replace(base, name=f"d{i}", alpha=d.alpha, token_s=d.token_s * cpu, forward_s=d.forward_s * cpu,
                             prefill_token_s=base.prefill_token_s * cpu, send_s=d.send_s,
                             lookahead_token_s=d.lookahead_token_s * cpu, proposal_rate=d.proposal_rate,
                             rtt_s=max(0.0, max(rtts[i], d.link_s) - knobs.jitter_s), jitter_s=knobs.jitter_s,
                             concurrency=max(1, row["concurrency"] // n), requests=requests // n,
                             arrivals=tuple(arrivals[i::n]), starts=tuple(sends[i::n]),
                             send_rows=0.0 if knobs.spread else d.send_rows,  # the measured spread has it
                             draft_spread=d.draft_spread if knobs.spread else None,
                             send_spread=d.send_spread if knobs.spread else None))
    return tuple(specs)


def edge_background(row: dict[str, Any]) -> float:
    """The run's edge CPU beyond its draft models (coordinator, load client and proxies, the
    drafters' event loops) per second of its window: the always-running jobs' worth that shares
    the edge core with the draft models (``SimSpec.edge_background``); 0 when not recorded."""
    cpu, own = row["costs"].get("cpu", {}), list(row["costs"].get("by_drafter", {}).values())
    if not cpu.get("wall_s") or not own or not all("model_cpu_s" in d for d in own):
        return 0.0
    edge = sum(v for k, v in cpu.items() if k in ("coordinator_s", "client_s") or k.startswith("drafter"))
    return max(0.0, edge - sum(d["model_cpu_s"] for d in own)) / cpu["wall_s"]


def measured_waits(row: dict[str, Any]) -> list[float] | None:
    """Each drafter's mean seconds from a draft leaving to starting on its session's next round:
    its rounds' verify_wait plus the run's worker_wait (None: not recorded per drafter)."""
    own = [d for _, d in sorted(row["costs"].get("by_drafter", {}).items())]
    if not own or not all(d.get("verify_wait_ms") for d in own):
        return None
    return [(d["verify_wait_ms"] + row.get("round_ms", {}).get("worker_wait", 0.0)) / 1e3 for d in own]


def step_scale(row: dict[str, Any], coef: Coef, prompt_len: int = PROMPT_LEN) -> float:
    """The run's measured mean forward over the profile's estimate of it at the run's mean batch
    (its sessions per step, each feeding the run's mean tokens per session, or else 1 + its mean
    draft length, at a mid-request context): the
    real verifier refits its estimator online to the forwards it measures; this does it once."""
    c = row["costs"]
    sessions, forward_s = c.get("batch_sessions") or 0.0, c.get("forward_ms", 0.0) / 1e3
    if sessions <= 0 or forward_s <= 0:
        return 1.0
    if c.get("batch_tokens"):  # the tokens its steps fed: fill steps (one each) and prefill among them
        new = c["batch_tokens"] / sessions
    else:
        new = 1.0 + (c["drafted_per_round"] if row["scenario"] not in TARGET_ONLY else 0.0)
    context = prompt_len + int(row.get("max_tokens", 128)) / 2
    predicted = StepTimeEstimator(coef).predict_sums(sessions * new, sessions * (context + new) * new,
                                                     sessions * context)
    return forward_s / predicted


def spec_of(source: str, row: dict[str, Any], meta: dict[str, Any], coef: Coef, repeat: int = 0,
            knobs: Knobs = DEFAULTS) -> SimSpec | None:
    """The simulation of ``row`` (None: a scenario the simulator does not model)."""
    pol = policies_of(source, row, meta)
    if pol is None:
        return None
    c = row["costs"]
    overhead = max(0.0, c["step_ms"] - c["forward_ms"]) / 1e3
    closed = not row.get("arrival_rate", 0) > 0
    loop = verifier_loop_s(c.get("cpu", {}))
    drafters = drafters_of(source, row, meta, repeat, pol.controller == "fixed", knobs)
    fill = knobs.fill and row["scenario"] != NO_FILL  # that fleet's verifier did not fill
    scale = step_scale(row, coef, meta.get("prompt_len", PROMPT_LEN))
    return SimSpec(drafters, pol, VerifierSpec(32, 2048, overhead, loop, fill),
                   CostSpec("cpu", coef, scale=scale), speculative=row["scenario"] not in TARGET_ONLY,
                   auto=row.get("speculation") == "auto",
                   rounds=None, duration_s=3600.0, shared_requests=int(row.get("requests", 30)) if closed else 0,
                   edge_cores=knobs.edge_cores, edge_background=edge_background(row) if knobs.edge_cores else 0.0)


def compare(source: str, row: dict[str, Any], meta: dict[str, Any], coef: Coef,
            knobs: Knobs = DEFAULTS) -> dict[str, Any]:
    out = {"source": source, "scenario": row["scenario"], "point": row["point"],
           "real_tok_s": row["goodput_tok_s"], "real_latency_s": row["latency_s_mean"]}
    repeats = max(1, len(row.get("tokens_per_s_runs", [])))
    specs = [spec_of(source, row, meta, coef, i, knobs) for i in range(repeats)]
    first = specs[0]
    if first is None:
        return {**out, "skipped": "not modelled (the simulator's verifier keeps every session's KV cache)"}
    sims = [simulate(replace(spec, seed=seed)) for spec in specs if spec is not None for seed in range(knobs.seeds)]
    by_drafter = row["costs"].get("by_drafter", {})
    # as the real row: the median rate over the repeats (and seeds), the mean latency over all their requests
    tok_s = statistics.median(r.goodput_tok_s for r in sims)
    latency = sum((r.latency_s or 0.0) * r.requests_done for r in sims) / max(1, sum(r.requests_done for r in sims))
    out.update(sim_tok_s=tok_s, sim_latency_s=latency, alpha=first.drafters[0].alpha, repeats=repeats,
               prompt_len=first.drafters[0].prompt_len,
               alphas=[d.alpha for d in first.drafters], step_scale=first.cost.scale,
               rtts_ms=[d.rtt_s * 1e3 for d in first.drafters] if first.speculative else [],
               sim_lookahead_use=sum(r.lookaheads_used for r in sims) / max(1, sum(r.drafted_rounds for r in sims)),
               real_lookahead_use=lookahead_use(row),
               sim_conditional_use=sum(r.conditional_taken for r in sims) / max(1, sum(r.drafted_rounds for r in sims)),
               real_conditional_use=lookahead_use(row, "presented"), sim_verdict_wait_ms=verdict_waits_ms(sims),
               real_verdict_wait_ms=[w * 1e3 for w in measured_waits(row) or []],
               sim_draft_batch=per_drafter_mean([r.draft_batch_sessions for r in sims]),
               sim_fill_wait_deviation_ms=[None if v is None else v * 1e3
                                           for v in per_drafter_mean([r.fill_wait_deviation_s for r in sims])],
               real_fill_wait_deviation_ms=[row["costs"].get("fill_waits", {}).get(name, {}).get("deviation_ms")
                                            for name in sorted(by_drafter)],
               real_draft_batch=[d.get("batch_sessions") for _, d in sorted(by_drafter.items())],
               sim_drafted_share=statistics.fmean(r.drafted_share or 0.0 for r in sims),
               real_drafted_share=row.get("drafted_share"))
    out["tok_s_error"] = tok_s / row["goodput_tok_s"] - 1
    out["latency_error"] = latency / row["latency_s_mean"] - 1 if row["latency_s_mean"] else math.nan
    out["within"] = abs(out["tok_s_error"]) <= TOLERANCE and abs(out["latency_error"]) <= TOLERANCE
    return out


def verdict_waits_ms(sims: list[SimResult]) -> list[float | None]:
    """Each simulated drafter's mean verdict wait (``SimResult.verdict_wait_s``) over the repeats."""
    return [None if w is None else w * 1e3 for w in per_drafter_mean([r.verdict_wait_s for r in sims])]


def per_drafter_mean(runs: list[tuple[float | None, ...]]) -> list[float | None]:
    """Each drafter's mean of a per-drafter value over the repeats, skipping those without one."""
    out: list[float | None] = []
    for i in range(len(runs[0])):
        values = [v for run in runs if (v := run[i]) is not None]
        out.append(statistics.fmean(values) if values else None)
    return out


def lookahead_use(row: dict[str, Any], key: str = "lookaheads_used") -> float | None:
    """The share of the real run's drafted rounds whose draft was a lookahead (``presented``: one
    the verifier held already, a conditional draft; None: not recorded)."""
    own = row["costs"].get("by_drafter", {}).values()
    rounds = sum(d.get("rounds", 0.0) for d in own)
    if not rounds or not all(key in d for d in own):
        return None
    return sum(d[key] for d in own) / rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench sim-validate", description=__doc__.splitlines()[0])
    p.add_argument("--results", default="bench/results", help="folder of the real runs' JSON files")
    p.add_argument("--sources", default=",".join(SOURCES), help=f"comma list of {', '.join(SOURCES)}")
    p.add_argument("--estimator-file", default=str(DEFAULT_PROFILE), help="the verifier's step-time profile")
    p.add_argument("--draft-forward-rows", type=float, default=DRAFT_FORWARD_ROWS,
                   help="a draft-model forward's fixed cost in rows' worth (`python -m bench.costs --draft-batches`); "
                        "0: a batch's draft cost is proportional to its rows")
    p.add_argument("--fill", action="store_true",
                   help="simulate the verifier filling while drafts travel, riders included, as the real runs' "
                        "verifiers have by default since 2026-12-03 (off by default: for the runs before, "
                        f"without riders, the simulator filled more than they did; never for '{NO_FILL}' rows, "
                        "whose verifier did not fill)")
    p.add_argument("--jitter-ms", type=float, default=0.0,
                   help="a uniform extra delay in [0, this] on each simulated draft and verdict, one way (the real "
                        "runs' links had none configured; their event loops spread frames by an unmeasured amount)")
    p.add_argument("--edge-cores", type=float, default=0.0,
                   help="simulate the drafters sharing this many CPU cores, as the real runs' pinned edge core (1), "
                        "with their draft models' measured CPU seconds (runs since 2026-11-27 03:45); 0: each "
                        "drafter computes on its own")
    p.add_argument("--spread", action="store_true",
                   help="each simulated drafter's batches and hand-offs spread as its real rounds' draft and send "
                        "phases did (their histograms, runs since 2026-11-27 04:15), around the same means")
    p.add_argument("--seeds", type=int, default=5,
                   help="simulations per real repeat, with seeds 0 to this − 1; a row takes their median rate and "
                        "the mean latency over all their requests")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--stem", default="sim-validation", help="results file names: <stem>.json and <stem>.md")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds must be at least 1, got {args.seeds}")
    knobs = Knobs(args.draft_forward_rows, args.fill, args.jitter_ms / 1e3, args.edge_cores, args.spread, args.seeds)
    coef = load_cpu_coef(args.estimator_file)
    rows, used = [], []
    for source in args.sources.split(","):
        path = Path(args.results) / f"{source}.json"
        if not path.exists():
            print(f"skipping {source}: no {path} (run `python -m bench {source}` first)")
            continue
        data = json.loads(path.read_text())
        used.append(f"{path} ({data['meta']['when']})")
        file_meta = {**data["meta"], "prompt_len": prompt_len_of(data["rows"])}
        rows += [compare(source, row, file_meta, coef, knobs) for row in data["rows"]]
    if not rows:
        p.error(f"no real results to compare with in {args.results}")
    meta = {"command": "python -m bench sim-validate " + " ".join(argv or []), "sources": used,
            "when": time.strftime("%Y-%m-%d %H:%M"), "coef": coef, "draft_forward_rows": args.draft_forward_rows,
            "fill": args.fill, "jitter_ms": args.jitter_ms, "edge_cores": args.edge_cores, "spread": args.spread,
            "seeds": args.seeds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_results(out, args.stem, {"meta": meta, "rows": rows}, markdown(rows, meta, TOLERANCE))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
