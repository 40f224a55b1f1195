"""The scenario benchmarks' pure parts: run metrics, arrival traces, fairness and SLO reductions,
the simulator's validation maths, and where an edge drafter finds the queue."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from bench.capacity import NO_FILL
from bench.capacity import scenarios as capacity_scenarios
from bench.client import Outcome
from bench.fairness import settle_round
from bench.fleets import Run, bodies
from bench.load import requests_at
from bench.load import scenarios as load_scenarios
from bench.run_stats import (
    client_slo_by_class,
    cpu_split,
    drafter_costs,
    fill_waits,
    jain,
    per_drafter_drafts,
    per_drafter_goodput,
    round_breakdown,
    round_draft_ms_per_token,
    slo_by_class,
    sum_log,
)
from bench.scrape import Snapshot
from bench.sim.validate import (
    PROMPT_LEN,
    Knobs,
    acceptance_of,
    alpha_for,
    drafter_params,
    edge_background,
    link_s,
    measured_waits,
    policies_of,
    prompt_len_of,
    spec_of,
    split_draft_cost,
    step_scale,
    verifier_loop_s,
)
from bench.slo import capacity, violations
from bench.traces import TRACES, rate_profile, trace_arrivals
from services.verifier.batching.estimator import StepTimeEstimator


def snap(**samples: float) -> Snapshot:
    """A Snapshot of unlabelled samples, name=value."""
    return Snapshot({(name, ()): value for name, value in samples.items()})


@pytest.mark.parametrize(("values", "expected"), [
    ([5.0, 5.0, 5.0], 1.0), ([1.0, 0.0, 0.0, 0.0], 0.25), ([1.0, 3.0], 16 / 20), ([], math.nan)])
def test_jain_index(values: list[float], expected: float) -> None:
    got = jain(values)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


def test_sum_log_counts_a_starved_drafter_as_1e_minus_9() -> None:
    assert sum_log([math.e, math.e]) == pytest.approx(2.0)
    assert sum_log([1.0, 0.0]) == pytest.approx(math.log(1e-9))


def test_per_drafter_goodput_counts_each_round_and_its_accepted_drafts_over_the_run() -> None:
    run = Run("s", 2, [1.0], [], {"verifier": Snapshot(),
                                   "drafter-1": snap(specfleet_drafter_rounds_total=10,
                                                     specfleet_drafter_accepted_tokens_total=30),
                                   "drafter-2": snap(specfleet_drafter_rounds_total=20)}, walls=[2.0, 3.0])
    assert per_drafter_goodput(run) == {"drafter-1": 8.0, "drafter-2": 4.0}


def test_per_drafter_goodput_counts_every_token_its_sessions_got_where_the_drafter_counted_them() -> None:
    """Rounds the verifier ran target-only (budget 0) and fills are in ``committed_tokens``, not in
    the rounds: a drafter GoodSpeed gave no budget still served its sessions' tokens."""
    run = Run("s", 2, [1.0], [], {"verifier": Snapshot(),
                                   "drafter-1": snap(specfleet_drafter_rounds_total=10,
                                                     specfleet_drafter_accepted_tokens_total=30,
                                                     specfleet_drafter_committed_tokens_total=45),
                                   "drafter-2": snap(specfleet_drafter_rounds_total=2,
                                                     specfleet_drafter_committed_tokens_total=25)}, walls=[5.0])
    assert per_drafter_goodput(run) == {"drafter-1": 9.0, "drafter-2": 5.0}


def test_per_drafter_drafts_give_each_drafters_share_of_the_drafts_and_its_acceptance() -> None:
    run = Run("s", 2, [1.0], [], {"verifier": Snapshot(),
                                   "drafter-1": snap(specfleet_drafter_drafted_tokens_total=60,
                                                     specfleet_drafter_accepted_tokens_total=54),
                                   "drafter-2": snap(specfleet_drafter_drafted_tokens_total=20,
                                                     specfleet_drafter_accepted_tokens_total=5),
                                   "drafter-3": snap()})  # given no budget: drafted nothing
    assert per_drafter_drafts(run) == {"drafter-1": {"acceptance": 0.9, "draft_share": 0.75},
                                       "drafter-2": {"acceptance": 0.25, "draft_share": 0.25},
                                       "drafter-3": {"acceptance": 0.0, "draft_share": 0.0}}


def test_cpu_split_gives_each_service_and_the_client_over_the_window() -> None:
    cpu, h = "process_cpu_seconds_total", "specfleet_verifier_step_seconds_sum"
    run = Run("s", 2, [1.0], [], {"verifier": Snapshot({(cpu, ()): 4.0, (h, (("phase", "total"),)): 3.0,
                                                        ("specfleet_verifier_rounds_total", ()): 100.0,
                                                        ("specfleet_verifier_filled_tokens_total", ()): 30.0}),
                                   "coordinator": snap(process_cpu_seconds_total=0.5),
                                   "drafter-1": snap(process_cpu_seconds_total=2.0, specfleet_drafter_rounds_total=40,
                                                     specfleet_drafter_model_busy_seconds_total=1.5)},
              walls=[2.0, 3.0], client_cpu_s=0.25)
    assert cpu_split(run) == {"coordinator_s": 0.5, "drafter-1_s": 2.0, "verifier_s": 4.0, "client_s": 0.25,
                              "wall_s": 5.0, "verifier_steps_s": 3.0, "verifier_rounds": 100.0,
                              "verifier_filled": 30.0, "draft_busy_s": 1.5, "lookahead_busy_s": 0.0}


def test_slo_attainment_is_per_class() -> None:
    key = "specfleet_verifier_slo_requests_total"
    v = Snapshot({(key, (("outcome", "attained"), ("slo_class", "10"))): 3.0,
                  (key, (("outcome", "violated"), ("slo_class", "10"))): 1.0,
                  (key, (("outcome", "attained"), ("slo_class", "40"))): 2.0})
    assert slo_by_class(v) == {"10": {"requests": 4.0, "attainment": 0.75}, "40": {"requests": 2.0, "attainment": 1.0}}
    row = {"slo": slo_by_class(v), "scenario": "wisp", "concurrency": 8}
    assert violations(row) == pytest.approx(1 / 6)
    assert capacity([row], "wisp", 0.2) == 8 and capacity([row], "wisp", 0.1) == 0


def test_the_clients_slo_view_counts_the_whole_request() -> None:
    """A request meets its class end to end when its tokens over send-to-last-token reach it: the
    client's view, which also holds the time before the verifier saw the request."""
    outcomes = [Outcome(64, 1.0, 0, 0, slo_tokens_per_s=60.0), Outcome(64, 1.1, 0, 0, slo_tokens_per_s=60.0),
                Outcome(64, 3.3, 0, 0, slo_tokens_per_s=20.0), Outcome(64, 9.0, 0, 0)]
    assert [o.slo_met for o in outcomes] == [True, False, False, True]
    assert client_slo_by_class(outcomes) == {"60": {"requests": 2.0, "attainment": 0.5},
                                            "20": {"requests": 1.0, "attainment": 0.0}}
    verifier = {"60": {"requests": 2.0, "attainment": 1.0}, "20": {"requests": 1.0, "attainment": 1.0}}
    row = {"slo": verifier, "slo_client": client_slo_by_class(outcomes), "scenario": "wisp", "concurrency": 8}
    assert violations(row) == pytest.approx(2 / 3) and violations(row, "slo") == 0.0
    assert violations({"slo": verifier}) == 0.0  # rows from before the client's count: the verifier's

def test_round_breakdown_averages_each_phase_over_all_drafters() -> None:
    h = "specfleet_drafter_round_phase_seconds"
    run = Run("s", 1, [1.0], [], {"drafter-1": Snapshot({(f"{h}_sum", (("phase", "draft"),)): 0.3,
                                                         (f"{h}_count", (("phase", "draft"),)): 3.0}),
                                  "drafter-2": Snapshot({(f"{h}_sum", (("phase", "draft"),)): 0.1,
                                                         (f"{h}_count", (("phase", "draft"),)): 1.0})})
    assert round_breakdown(run)["draft"] == pytest.approx(100.0)
    assert round_breakdown(run)["send"] == 0.0


@pytest.mark.parametrize("kind", TRACES)
def test_traces_are_seeded_sorted_and_keep_their_mean_rate(kind: str) -> None:
    times = trace_arrivals(kind, 10.0, 2000, seed=3)
    assert times == trace_arrivals(kind, 10.0, 2000, seed=3) != trace_arrivals(kind, 10.0, 2000, seed=4)
    assert times == sorted(times) and len(times) == 2000
    assert 2000 / times[-1] == pytest.approx(10.0, rel=0.15)


def test_bursty_traces_are_burstier_than_poisson() -> None:
    def spread(kind: str) -> float:
        profile = rate_profile(trace_arrivals(kind, 10.0, 4000, seed=1, period_s=100.0), bins=40)
        return statistics.pstdev(profile) / statistics.mean(profile)
    assert spread("varying") > 2 * spread("poisson")
    assert spread("periodic") > 2 * spread("poisson")
    with pytest.raises(ValueError, match="unknown trace"):
        trace_arrivals("sawtooth", 1.0, 3)


@pytest.mark.parametrize(("rate", "least", "seconds", "expected"), [
    (2.0, 32, 4.0, 32), (12.0, 32, 4.0, 48), (36.0, 32, 4.0, 144), (0.5, 8, 0.0, 8), (7.5, 1, 2.0, 15)])
def test_a_load_repeat_spans_its_seconds_of_arrivals_or_its_least_requests(rate: float, least: int, seconds: float,
                                                                             expected: int) -> None:
    assert requests_at(rate, least, seconds) == expected


def test_requests_carry_their_slo_class_in_turn() -> None:
    reqs = bodies(5, 8, "m", slo_classes=[10.0, 20.0])
    assert [r["slo_tokens_per_s"] for r in reqs] == [10.0, 20.0, 10.0, 20.0, 10.0]
    assert "slo_tokens_per_s" not in bodies(1, 8, "m")[0]


def test_utility_settles_when_its_rolling_mean_stays_near_the_end() -> None:
    trace = [(r, 1.0 if r < 50 else 2.0) for r in range(0, 100, 5)]
    final, settled = settle_round(trace, 0.05, window=1)
    assert final == pytest.approx(2.0) and settled == 50
    assert settle_round([(0, 0.0), (1, 5.0), (2, 0.0), (3, 5.0)], 0.1, window=1)[1] is None
    assert settle_round([], 0.1) == (pytest.approx(math.nan, nan_ok=True), None)


@pytest.mark.parametrize(("accepted", "drafted", "alpha"), [(0.0, 4.0, 0.0), (4.0, 4.0, 1.0), (1.0, 1.0, 1.0),
                                                             (0.5, 1.0, 0.5), (0.5 + 0.25, 2.0, 0.5)])
def test_alpha_reproduces_the_measured_accepted_prefix(accepted: float, drafted: float, alpha: float) -> None:
    assert alpha_for(accepted, drafted) == pytest.approx(alpha, abs=1e-6)


def test_validation_maps_each_real_scenario_to_the_policies_it_ran() -> None:
    meta = {"capacity": 12, "drafters": [["small", 0], ["large", 10], ["ngram", 40]]}
    assert policies_of("fairness", {"scenario": "goodspeed"}, meta).allocation == "goodspeed"  # type: ignore[union-attr]
    assert policies_of("load", {"scenario": "fixed k=3"}, {}).draft_len == 3  # type: ignore[union-attr]
    assert policies_of("load", {"scenario": "adaspec", "draft_len": 5}, {}).controller == "adaspec"  # type: ignore[union-attr]
    assert policies_of("capacity", {"scenario": "SLED-like"}, {}) is None


COEF = (2e-4, 1.3e-7, 1.9e-6, 9e-3)


def real_row(**costs: object) -> dict[str, object]:
    """A closed-loop fairness-shaped result row with the given measured costs."""
    base = {"forward_ms": 12.0, "step_ms": 13.0, "batch_sessions": 2.0, "draft_ms_per_token": 5.0,
            "drafted_per_round": 4.0}
    return {"scenario": "fixed", "point": "@2", "concurrency": 2, "requests": 10, "max_tokens": 64,
            "arrival_rate": 0.0, "goodput_by_drafter": {"drafter-1": 1.0, "drafter-2": 1.0},
            "mean_accepted_per_round": 2.0, "costs": {**base, **costs}}


def test_step_scale_matches_the_measured_forward_at_the_runs_mean_batch() -> None:
    row = real_row()
    scale = step_scale(row, COEF)
    sessions, new, context = 2.0, 5.0, 12 + 32
    predicted = StepTimeEstimator(COEF).predict_sums(sessions * new, sessions * (context + new) * new,
                                                     sessions * context)
    assert scale * predicted == pytest.approx(0.012)
    assert step_scale(real_row(batch_sessions=0.0), COEF) == 1.0
    # a run that recorded its steps' tokens (fill steps among them, one token each): those, per session
    filled = step_scale(real_row(batch_tokens=3.0), COEF)
    at = StepTimeEstimator(COEF).predict_sums(3.0, sessions * (context + 1.5) * 1.5, sessions * context)
    assert filled * at == pytest.approx(0.012)


def counted_prompts(scenario: str, prefill: float, requests: float = 128.0) -> dict[str, object]:
    return {**real_row(prefill_tokens=prefill), "scenario": scenario, "slo": {"none": {"requests": requests}}}


@pytest.mark.parametrize(("rows", "want"), [
    # the verifier prefilled 6.3 tokens a request; the first round feeds the prompt's last
    ([counted_prompts("centralized", 0.0), counted_prompts("specfleet", 808.0)], 7),
    ([counted_prompts("SLED-like", 13600.0), counted_prompts("fixed", 300.0, 30)], 11),  # SLED prefills every round
    # a first round that came before its prompt was cached fed the rest itself: the fullest count
    ([counted_prompts("goodspeed", 230.0, 30), counted_prompts("fixed", 329.0, 30)], 12),
    ([counted_prompts("centralized", 0.0)], PROMPT_LEN),  # target-only: its prompts fed uncounted
    ([real_row()], PROMPT_LEN),  # an older file: not recorded
])
def test_a_files_prompt_length_is_what_its_verifier_prefilled_per_request(rows: list[dict[str, Any]],
                                                                          want: int) -> None:
    assert prompt_len_of(rows) == want
    spec = spec_of("fairness", rows[-1], {"drafters": [["small", 0]] * 2, "prompt_len": want}, COEF)
    assert spec is not None and {d.prompt_len for d in spec.drafters} == {want}
    assert spec.cost.scale == pytest.approx(step_scale(rows[-1], COEF, want))


def test_drafter_params_are_per_drafter_when_the_run_recorded_them() -> None:
    pooled = drafter_params(real_row(), 2)
    assert pooled[0] == pooled[1] and pooled[0][1] == pytest.approx(5e-3)
    own = {"drafter-1": {"draft_ms_per_token": 1.0, "drafted_per_round": 2.0, "accepted_per_round": 2.0},
           "drafter-2": {"draft_ms_per_token": 8.0, "drafted_per_round": 4.0, "accepted_per_round": 0.0}}
    d1, d2 = drafter_params(real_row(by_drafter=own), 2)
    assert (d1.alpha, d1.token_s) == (pytest.approx(1.0), pytest.approx(1e-3))
    assert (d2.alpha, d2.token_s) == (pytest.approx(0.0), pytest.approx(8e-3))
    assert d1.send_s == d1.link_s == d1.lookahead_token_s == d2.send_s == 0.0  # none of these recorded
    own["drafter-1"].update(lookahead_busy_s=2.4, lookaheads=400)  # 400 lookaheads of 2 drafts and the guess
    assert drafter_params(real_row(by_drafter=own), 2)[0].lookahead_token_s == pytest.approx(2e-3)


@pytest.mark.parametrize(("token_s", "rows", "forward_rows", "want"), [
    (1e-3, 4.0, 4.0, (5e-4, 2e-3)),  # a forward of 4 rows: 2 ms fixed + 4 × 0.5 ms = 4 × the measured 1 ms
    (1e-3, 1.0, 4.0, (2e-4, 8e-4)),  # batches of 1: most of the measured cost is the forward's fixed cost
    (1e-3, 0.0, 4.0, (1e-3, 0.0)),  # an older run: its batches were not recorded
    (1e-3, 4.0, 0.0, (1e-3, 0.0)),  # a cost proportional to the rows
])
def test_a_measured_draft_cost_splits_into_a_forwards_fixed_cost_and_a_cost_per_row(
        token_s: float, rows: float, forward_rows: float, want: tuple[float, float]) -> None:
    row_s, forward_s = split_draft_cost(token_s, rows, forward_rows)
    assert (row_s, forward_s) == pytest.approx(want)
    if rows > 0:
        assert forward_s + rows * row_s == pytest.approx(rows * token_s)


def test_drafter_params_split_the_draft_cost_at_the_batches_each_drafter_ran() -> None:
    own = {"drafter-1": {"draft_ms_per_token": 1.0, "drafted_per_round": 2.0, "accepted_per_round": 1.0,
                         "batch_sessions": 4.0},
           "drafter-2": {"draft_ms_per_token": 1.0, "drafted_per_round": 2.0, "accepted_per_round": 1.0}}
    d1, d2 = drafter_params(real_row(by_drafter=own), 2, forward_rows=4.0)
    assert (d1.token_s, d1.forward_s) == (pytest.approx(5e-4), pytest.approx(2e-3))
    assert (d2.token_s, d2.forward_s) == (pytest.approx(1e-3), 0.0)  # its batches not recorded


def test_a_drafters_batch_sessions_are_its_round_batches_mean() -> None:
    name = "specfleet_drafter_draft_batch_sessions"
    s = Snapshot({(f"{name}_sum", (("kind", "round"),)): 12.0, (f"{name}_count", (("kind", "round"),)): 4.0,
                  (f"{name}_sum", (("kind", "lookahead"),)): 3.0, (f"{name}_count", (("kind", "lookahead"),)): 3.0})
    assert drafter_costs(s)["batch_sessions"] == 3.0  # 12 sessions in 4 round batches; lookaheads apart
    assert drafter_costs(Snapshot())["batch_sessions"] == 0.0  # none recorded: the validation does not split


def test_a_drafters_cost_per_token_is_over_the_tokens_its_rounds_drafted_then() -> None:
    d = "specfleet_drafter"
    s = Snapshot({(f"{d}_model_busy_seconds_total", ()): 3.0, (f"{d}_lookahead_busy_seconds_total", ()): 1.0,
                  (f"{d}_rounds_total", ()): 10.0, (f"{d}_drafted_tokens_total", ()): 40.0,
                  (f"{d}_round_drafted_tokens_total", ()): 20.0})
    costs = drafter_costs(s)
    # 2 s of round batches drafted 20 tokens; the other 20 were sent from lookaheads (their 1 s apart)
    assert (costs["draft_ms_per_token"], costs["round_drafted_per_round"]) == (100.0, 2.0)
    del s[(f"{d}_round_drafted_tokens_total", ())]  # a drafter from before the counter: every token sent
    assert drafter_costs(s)["draft_ms_per_token"] == 50.0


@pytest.mark.parametrize(("costs", "want_ms"), [
    ({"rounds": 540.0, "lookaheads_used": 270.0}, 2.5),  # an older file: half its rounds drafted nothing
    ({"rounds": 540.0, "lookaheads_used": 270.0, "round_drafted_per_round": 2.0}, 1.25),  # counted apart already
    ({}, 1.25),  # lookaheads not recorded
    ({"rounds": 10.0, "lookaheads_used": 10.0}, 1.25),  # no round drafted: nothing to scale by
])
def test_an_older_files_round_cost_per_token_leaves_out_the_rounds_that_took_a_lookahead(
        costs: dict[str, float], want_ms: float) -> None:
    d = {"draft_ms_per_token": 1.25, "drafted_per_round": 4.0, "accepted_per_round": 2.0, **costs}
    assert round_draft_ms_per_token(d) == pytest.approx(want_ms)
    [p] = drafter_params(real_row(by_drafter={"drafter-1": d}), 1)
    assert p.token_s == pytest.approx(want_ms / 1e3)  # batches not recorded: all of it per row


def test_measured_waits_are_each_drafters_verify_wait_and_the_runs_worker_wait() -> None:
    own = {"drafter-2": {"verify_wait_ms": 30.0}, "drafter-1": {"verify_wait_ms": 10.0}}
    row = {**real_row(by_drafter=own), "round_ms": {"worker_wait": 2.0}}
    assert measured_waits(row) == pytest.approx([0.012, 0.032])  # in the drafters' order
    assert measured_waits(real_row()) is None  # not recorded per drafter
    own["drafter-1"] = {}
    assert measured_waits(real_row(by_drafter=own)) is None


def prefix_sum(x: float, k: float) -> float:
    return x * (1 - x**k) / (1 - x)


@pytest.mark.parametrize(("asked", "whole_drafts", "short"), [
    (None, True, False),  # an older run: the ask was not counted
    (2.861, True, False),  # every round drafted all it asked for
    (4.0, False, False),  # another controller: its own stops, which the simulator runs, made drafts short
    (4.0, True, True),  # the fixed controller: the proposer ran out
])
def test_acceptance_of_a_proposer_that_runs_out(asked: float | None, whole_drafts: bool, short: bool) -> None:
    d = {"drafted_per_round": 2.861, "accepted_per_round": 2.23, **({"asked_per_round": asked} if asked else {})}
    alpha, rate = acceptance_of(d, whole_drafts)
    if not short:
        assert (alpha, rate) == (alpha_for(2.23, 2.861), 1.0)
        return
    assert prefix_sum(rate, 4.0) == pytest.approx(2.861)  # j or more drafted with probability ρ^j
    assert prefix_sum(alpha * rate, 4.0) == pytest.approx(2.23)  # j or more drafted and accepted: (ρα)^j
    assert rate < 1.0 and alpha > alpha_for(2.23, 2.861)  # fewer drafts, each likelier to be right
    own = {"drafter-1": {**d, "draft_ms_per_token": 0.01}}
    [p] = drafter_params(real_row(by_drafter=own), 1, whole_drafts)
    assert (p.alpha, p.proposal_rate) == (pytest.approx(alpha), pytest.approx(rate))


@pytest.mark.parametrize(("costs", "verify_wait_ms", "want"), [
    ({"step_ms": 13.0}, 30.0, 0.0),  # an older run: no queue wait recorded
    ({"step_ms": 13.0, "queue_wait_ms": 4.0, "publish_ms": 1.0}, 30.0, 0.012),
    ({"step_ms": 13.0, "queue_wait_ms": 4.0, "publish_ms": 1.0}, 15.0, 0.0),  # never below 0
])
def test_link_s_is_the_verdict_wait_beyond_the_verifiers_own_time(costs: dict[str, float], verify_wait_ms: float,
                                                                   want: float) -> None:
    assert link_s(costs, verify_wait_ms) == pytest.approx(want)


@pytest.mark.parametrize(("batch_sessions", "want_ms"), [
    (1.0, 12.0),  # a session alone: nothing else holds either end up
    # 4 sessions per step: 3/4 of (verifier busy 0.5 · 13 ms step + drafter held 3 ms) / 2 = 3.5625 ms
    (4.0, 12.0 - 3.5625),
])
def test_link_s_leaves_out_the_waits_for_a_receiver_busy_with_other_sessions(batch_sessions: float,
                                                                            want_ms: float) -> None:
    costs = {"step_ms": 13.0, "queue_wait_ms": 4.0, "publish_ms": 1.0, "batch_sessions": batch_sessions,
             "cpu": {"verifier_steps_s": 5.0, "wall_s": 10.0}}
    assert link_s(costs, 30.0, drafter_held_ms=3.0) == pytest.approx(want_ms / 1e3)


def test_a_drafters_held_time_weighs_round_batches_and_lookahead_tokens() -> None:
    """The drafter's event loop is held by round batches (the run's mean draft phase) for its round
    share of busy time, and by single lookahead tokens for the rest."""
    own = {name: {"draft_ms_per_token": 1.0, "drafted_per_round": 3.0, "accepted_per_round": 2.0,
                  "verify_wait_ms": 30.0, "model_busy_s": 4.0, "lookahead_busy_s": 2.0, "lookaheads": 250}
           for name in ("drafter-1", "drafter-2")}  # lookahead tokens: 2.0 s / (250 · 4) = 2 ms
    row = {**real_row(by_drafter=own, queue_wait_ms=4.0, publish_ms=1.0, batch_sessions=2.0,
                      cpu={"wall_s": 10.0, "verifier_steps_s": 0.0}), "round_ms": {"draft": 6.0}}
    held_ms = (2.0 * 6.0 + 2.0 * 2.0) / 10.0  # busy shares 0.2 and 0.2 of 6 ms batches and 2 ms tokens
    want = link_s(row["costs"], 30.0, held_ms)  # type: ignore[arg-type]
    assert want < link_s(row["costs"], 30.0)  # type: ignore[arg-type]
    assert [d.link_s for d in drafter_params(row, 2)] == pytest.approx([want, want])


def test_a_drafters_rtt_is_at_least_its_measured_link_time() -> None:
    own = {"drafter-1": {"draft_ms_per_token": 1.0, "drafted_per_round": 2.0, "accepted_per_round": 2.0,
                         "verify_wait_ms": 30.0},
           "drafter-2": {"draft_ms_per_token": 1.0, "drafted_per_round": 2.0, "accepted_per_round": 2.0,
                         "verify_wait_ms": 20.0}}
    row = real_row(by_drafter=own, queue_wait_ms=4.0, publish_ms=1.0)  # step_ms 13: links of 12 and 2 ms
    meta = {"drafters": [["small", 5], ["ngram", 40]], "capacity": 8}
    spec = spec_of("fairness", row, meta, COEF)
    assert spec is not None and [d.rtt_s for d in spec.drafters] == pytest.approx([0.012, 0.04])


def test_a_drafters_own_work_per_round_is_its_measured_hand_off_and_send() -> None:
    own = {"drafter-1": {"draft_ms_per_token": 1.0, "drafted_per_round": 2.0, "accepted_per_round": 2.0,
                         "send_ms": 0.5},
           "drafter-2": {"draft_ms_per_token": 1.0, "drafted_per_round": 2.0, "accepted_per_round": 2.0}}
    row = {**real_row(by_drafter=own), "round_ms": {"send": 2.0}}  # drafter-2 has only the pooled value
    assert [d.send_s for d in drafter_params(row, 2)] == pytest.approx([5e-4, 2e-3])


def test_verifier_loop_s_is_its_cpu_outside_steps_per_round() -> None:
    assert verifier_loop_s({}) == 0.0
    assert verifier_loop_s({"verifier_s": 5.0, "verifier_steps_s": 4.0, "verifier_rounds": 500}) == pytest.approx(2e-3)
    assert verifier_loop_s({"verifier_s": 3.9, "verifier_steps_s": 4.0, "verifier_rounds": 500}) == 0.0
    # each token filled while a draft travelled was streamed on its own, a session-step like a round
    assert verifier_loop_s({"verifier_s": 5.0, "verifier_steps_s": 4.0, "verifier_rounds": 200,
                            "verifier_filled": 300}) == pytest.approx(2e-3)
    meta = {"drafters": [["small", 0], ["ngram", 40]], "capacity": 8}
    spec = spec_of("fairness", real_row(cpu={"verifier_s": 5.0, "verifier_steps_s": 4.0, "verifier_rounds": 500}),
                   meta, COEF)
    assert spec is not None and spec.verifier.round_overhead_s == pytest.approx(2e-3)
    assert not spec.verifier.fill  # the validated simulation; --fill simulates the real verifiers' filling
    filled = spec_of("fairness", real_row(), meta, COEF, knobs=Knobs(fill=True))
    assert filled is not None and filled.verifier.fill


def test_fill_waits_are_per_drafter_means_of_the_verifiers_metrics() -> None:
    v, one = "specfleet_verifier_fill_wait", (("drafter", "drafter-1"),)
    snap = Snapshot({(f"{v}_seconds_count", one): 4.0, (f"{v}_seconds_sum", one): 0.2,
                     (f"{v}_seconds_bucket", (*one, ("le", "0.1"))): 4.0,
                     (f"{v}_deviation_seconds_total", one): 0.02,
                     (f"{v}_seconds_count", (("drafter", "drafter-2"),)): 0.0})
    assert fill_waits(snap) == {"drafter-1": {"n": 4.0, "mean_ms": pytest.approx(50.0),
                                              "deviation_ms": pytest.approx(5.0)}}
    assert fill_waits(Snapshot()) == {}


def test_a_closed_loop_row_draws_from_one_pool() -> None:
    meta = {"drafters": [["small", 0], ["ngram", 40]], "capacity": 8}
    spec = spec_of("fairness", real_row(), meta, COEF)
    assert spec is not None and spec.shared_requests == 10
    assert [d.rtt_s for d in spec.drafters] == [0.0, 0.04] and spec.cost.scale == pytest.approx(step_scale(
        real_row(), COEF))
    # a jitter of J keeps each measured round trip's mean: J/2 each way on average, so J less fixed
    jittered = spec_of("fairness", real_row(), meta, COEF, knobs=Knobs(jitter_s=0.002))
    assert jittered is not None and [(d.rtt_s, d.jitter_s) for d in jittered.drafters] == [
        (0.0, 0.002), (pytest.approx(0.038), 0.002)]


def test_the_no_fill_fleet_is_simulated_without_filling_whatever_the_flag() -> None:
    """``bench capacity --no-fill-too`` adds specfleet with the verifier's filling off; the
    validation simulates it as specfleet, never filling, and fills the others only with --fill."""
    fleets = {s.name: s for s in capacity_scenarios(Path("models/draft-small"), 2, 4, no_fill_too=True)}
    assert fleets[NO_FILL].verifier_flags == ("--allocation", "goodspeed", "--fill", "false")
    assert NO_FILL not in {s.name for s in capacity_scenarios(Path("models/draft-small"), 2, 4)}
    for name, filled in (("specfleet", True), (NO_FILL, False)):
        row = {**real_row(), "scenario": name, "point": "@2"}
        spec = spec_of("capacity", row, {}, COEF, knobs=Knobs(fill=True))
        assert spec is not None and spec.policies.allocation == "goodspeed" and spec.verifier.fill is filled


def test_on_shared_edge_cores_a_drafters_costs_are_its_draft_models_cpu_seconds() -> None:
    """``--edge-cores``: each drafter's measured costs times its model's CPU over busy seconds, and
    the edge's other CPU (coordinator, client, drafters beyond their models) as background."""
    own = {name: {"draft_ms_per_token": 2.0, "drafted_per_round": 4.0, "accepted_per_round": 2.0,
                  "model_busy_s": 4.0, "model_cpu_s": cpu_s}
           for name, cpu_s in (("drafter-1", 2.0), ("drafter-2", 4.0))}
    cpu = {"wall_s": 10.0, "coordinator_s": 1.0, "client_s": 0.5, "drafter-1_s": 3.0, "drafter-2_s": 5.0,
           "verifier_s": 9.0}
    row = real_row(by_drafter=own, cpu=cpu)
    assert edge_background(row) == pytest.approx((1.0 + 0.5 + 3.0 + 5.0 - 6.0) / 10.0)
    meta = {"drafters": [["small", 0], ["small", 0]], "capacity": 8}
    alone = spec_of("fairness", row, meta, COEF)
    shared = spec_of("fairness", row, meta, COEF, knobs=Knobs(edge_cores=1))
    assert alone is not None and shared is not None and alone.edge_cores == 0 and shared.edge_cores == 1
    assert shared.edge_background == pytest.approx(0.35) and alone.edge_background == 0
    assert [s.token_s / a.token_s for a, s in zip(alone.drafters, shared.drafters, strict=True)] == pytest.approx(
        [0.5, 1.0])
    assert edge_background(real_row(cpu=cpu)) == 0  # not recorded per drafter: no split


def test_bench_load_runs_adaspecs_trim_alone_and_whole_only_when_asked(tmp_path: Path) -> None:
    plain = load_scenarios(tmp_path, [2, 6], "")
    assert [sc.name for sc in plain] == ["no speculation", "fixed k=2", "fixed k=6", "smartspec", "adaspec"]
    assert not any("--trim" in sc.verifier_flags for sc in plain)
    with_trim = load_scenarios(tmp_path, [2, 6], "est.json", trim=True)
    assert [sc.name for sc in with_trim[5:]] == ["adaspec trim", "adaspec + trim"]
    trim, whole = with_trim[5:]
    assert trim.draft_len == whole.draft_len == 6  # the trim cuts the largest k
    assert list(trim.drafter_flags) == ["--send-confidence", "true"]
    assert list(whole.drafter_flags) == ["--controller", "adaspec"]
    for sc in (trim, whole):
        assert list(sc.verifier_flags) == ["--trim", "adaspec", "--estimator-file", "est.json"]
