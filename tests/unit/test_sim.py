"""The discrete-event simulator (bench.sim): round arithmetic at the extremes of α, target-only
mode, the real policies wired in (allocators' capacity, controllers stopping early, WISP's SLO
batching), the cost models, fairness metrics, determinism and the CLI end to end."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from bench.sim import (
    CostSpec,
    DrafterSpec,
    H100Cost,
    Policies,
    SimResult,
    SimSpec,
    VerifierSpec,
    load_cpu_coef,
    make_fleet,
    parse_alphas,
    simulate,
)
from bench.sim.__main__ import main
from bench.sim.engine import Simulation
from bench.sim.state import Edge, Kind, Lookahead, Session
from bench.sim.tokens import acceptance_prob, accepted_prefix, features
from bench.sim.validate import acceptance_of
from services.verifier.batching.estimator import DEFAULT_COEF, SegmentShape, StepTimeEstimator

H100 = CostSpec("h100")


def spec(alphas: list[float], rounds: int | None = 40, duration_s: float | None = None, **kw: object) -> SimSpec:
    """A small fleet: one session per drafter, 30-token requests, 10 ms RTT."""
    template = DrafterSpec("d", rtt_s=0.01, max_tokens=30, prompt_len=16)
    base = SimSpec(drafters=make_fleet(alphas, template), cost=H100, rounds=rounds, duration_s=duration_s)
    return replace(base, **kw)  # type: ignore[arg-type]


def run(alphas: list[float], **kw: object) -> SimResult:
    return simulate(spec(alphas, **kw))


# --- round arithmetic ---------------------------------------------------------------------------


def test_target_only_commits_one_token_per_round() -> None:
    r = run([0.9, 0.5, 0.1], speculative=False)
    assert r.rounds > 0 and r.drafted == 0
    assert r.committed == r.rounds
    assert r.rounds_per_token == 1.0


@pytest.mark.parametrize("k", [1, 2, 4])
def test_perfect_drafter_commits_budget_plus_one(k: int) -> None:
    # max_tokens a multiple of k + 1: even a request's last round has room for the whole budget
    fleet = make_fleet([1.0, 1.0], DrafterSpec("d", max_tokens=6 * (k + 1)))
    r = simulate(SimSpec(drafters=fleet, policies=Policies(draft_len=k), cost=H100, rounds=20))
    assert r.rounds > 0
    assert r.committed == r.rounds * (k + 1)
    assert r.accepted == r.drafted == r.rounds * k
    assert r.acceptance_rate == 1.0


@pytest.mark.parametrize("rate", [0.0, 0.5, 0.8])
def test_a_proposer_that_runs_out_drafts_rate_to_the_j_or_more(rate: float) -> None:
    """A model-free drafter (proposal_rate ρ) drafts j or more of the k asked with probability ρ^j,
    so Σ_{j≤k} ρ^j per round on average; every draft it has is accepted here (α = 1)."""
    k = 4
    fleet = make_fleet([1.0, 1.0], DrafterSpec("d", max_tokens=600, proposal_rate=rate))
    r = simulate(SimSpec(drafters=fleet, policies=Policies(draft_len=k), cost=H100, rounds=4000))
    assert r.accepted == r.drafted and r.committed == r.rounds + r.drafted
    want = sum(rate**j for j in range(1, k + 1))
    assert r.drafted / r.rounds == pytest.approx(want, abs=0.05)  # 8000 rounds: σ of the mean ≤ 0.02


def test_validation_recovers_a_simulated_proposers_rate_and_acceptance() -> None:
    """The simulator's drafted, accepted and asked-for tokens per round, pipelined (a lookahead asks
    for as many as its round did, and the proposer may run out then), give back its ρ and α."""
    fleet = make_fleet([0.8], DrafterSpec("d", max_tokens=2000, proposal_rate=0.7, pipeline_sessions=2))
    r = simulate(SimSpec(drafters=fleet, policies=Policies(draft_len=4), cost=H100, rounds=20000))
    assert r.lookaheads_used > 1000
    alpha, rate = acceptance_of({"drafted_per_round": r.drafted / r.rounds, "accepted_per_round": r.accepted / r.rounds,
                                 "asked_per_round": r.asked / r.rounds}, whole_drafts=True)
    assert (rate, alpha) == (pytest.approx(0.7, abs=0.01), pytest.approx(0.8, abs=0.01))


def test_hopeless_drafter_commits_one_token_per_round() -> None:
    r = run([0.0, 0.0])
    assert r.drafted > 0 and r.accepted == 0
    assert r.committed == r.rounds


@pytest.mark.parametrize("forward_s", [0.0, 3e-3])
@pytest.mark.parametrize(("max_batch", "batches"), [(4, [("d0-r0", "d0-r1", "d0-r2")]),
                                                   (2, [("d0-r0", "d0-r1"), ("d0-r2",)])])
def test_a_drafter_drafts_its_ready_sessions_as_one_batch(max_batch: int, batches: list[tuple[str, ...]],
                                                          forward_s: float) -> None:
    """Sessions ready together are drafted together (up to max_batch), and their drafts all leave
    send_s after the batch ends, which takes the sum of their draft costs and one forward's fixed
    cost per draft position."""
    d = DrafterSpec("d0", token_s=1e-3, round_s=2e-3, prefill_token_s=0.0, send_s=5e-4, concurrency=3,
                    max_batch=max_batch, forward_s=forward_s)
    sim = Simulation(SimSpec(drafters=(d,), cost=H100, rounds=3))  # every session drafted once at least
    started: list[float] = []
    done: list[tuple[float, tuple[str, ...]]] = []
    start, end = sim._start_batch, sim._draft_done

    def record_start(edge: Edge) -> None:
        started.append(sim.now)
        start(edge)

    def record_end(batch: tuple[Edge, tuple[Session, ...], float]) -> None:
        done.append((sim.now, tuple(s.sid for s in batch[1])))
        end(batch)
        assert all(s.sent_at == pytest.approx(sim.now + 5e-4) for s in batch[1])
    sim._start_batch = record_start  # type: ignore[method-assign]
    sim.handlers[Kind.DRAFT_DONE] = record_end
    sim.run()
    assert [sids for _, sids in done[: len(batches)]] == batches
    per_session = 2e-3 + 4 * 1e-3  # round_s + draft_len·token_s
    for began, (ended, sids) in zip(started, done[: len(batches)], strict=False):
        assert ended - began == pytest.approx(4 * forward_s + per_session * len(sids))


def test_a_batch_pays_one_forward_per_position_of_its_longest_draft() -> None:
    """Drafts of 4, 0 and 2 tokens in one batch: 4 forwards' fixed cost plus each session's own."""
    d = DrafterSpec("d0", token_s=1e-3, round_s=0.0, forward_s=3e-3, concurrency=3)
    sim = Simulation(SimSpec(drafters=(d,), cost=H100, rounds=1))
    own = iter([(4e-3, 4), (0.0, 0), (2e-3, 2)])
    sim._draft = lambda edge, s, rows: next(own)  # type: ignore[method-assign]
    edge = sim.edges[0]
    edge.queue.extend(Session(f"s{i}", edge, 16, 30, None, 0.0, None) for i in range(3))
    sim._start_batch(edge)
    at, (_, batch, _) = draft_done(sim)
    assert len(batch) == 3 and at == pytest.approx(4 * 3e-3 + 6e-3)


@pytest.mark.parametrize(("lookahead_token_s", "want"), [(0.0, 3e-3 + 2 * 1e-3), (2e-3, 2 * 2e-3)])
def test_a_lookahead_step_is_one_forward_over_its_rows_unless_its_cost_was_measured(lookahead_token_s: float,
                                                                                      want: float) -> None:
    d = DrafterSpec("d0", token_s=1e-3, forward_s=3e-3, lookahead_token_s=lookahead_token_s, concurrency=2)
    sim = Simulation(SimSpec(drafters=(d,), cost=H100, rounds=1))
    edge = sim.edges[0]
    for i in range(2):
        s = Session(f"s{i}", edge, 16, 30, None, 0.0, None)
        s.ahead = Lookahead(True, 4, 5)
        edge.looking.append(s)
    sim._start_lookahead_step(edge)
    while sim.events:
        at, kind, _ = sim.events.pop()
        if kind is Kind.LOOKAHEAD_STEP:
            assert at == pytest.approx(want)
            return
    raise AssertionError("no lookahead step was scheduled")


def draft_done(sim: Simulation) -> tuple[float, tuple[Edge, tuple[Session, ...], float]]:
    """The pending DRAFT_DONE event: when, and its payload."""
    while sim.events:
        at, kind, payload = sim.events.pop()
        if kind is Kind.DRAFT_DONE:
            return at, payload
    raise AssertionError("no batch was scheduled")


def test_the_verdict_wait_is_the_round_trip_and_the_verifiers_time() -> None:
    """One session alone: from its draft leaving to its next round, the RTT and the verifier's
    step (the same every round at α = 1), so a longer RTT adds exactly its difference."""
    def waits(rtt_s: float) -> tuple[float | None, ...]:
        d = DrafterSpec("d0", alpha=1.0, rtt_s=rtt_s, max_tokens=50, requests=2)
        return simulate(SimSpec(drafters=(d,), cost=H100, rounds=None, duration_s=600.0)).verdict_wait_s
    [near], [far] = waits(0.01), waits(0.04)
    assert near is not None and far is not None and near > 0.01
    assert far - near == pytest.approx(0.03)
    assert simulate(spec([0.5], speculative=False)).verdict_wait_s == (None,)  # no drafts, no verdicts for them


# --- filling while drafts travel ------------------------------------------------------------


def fill_run(alpha: float, fill: bool, rtt_s: float = 0.2, requests: int = 3) -> SimResult:
    """One session over a slow link, ``requests`` requests of 40 tokens, every one to its end."""
    d = DrafterSpec("d", alpha=alpha, rtt_s=rtt_s, max_tokens=40, prompt_len=16, requests=requests)
    return simulate(SimSpec(drafters=(d,), cost=H100, rounds=None, duration_s=3600.0,
                            verifier=VerifierSpec(fill=fill)))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_filling_commits_every_token_once_and_keeps_the_verifier_busy_over_a_slow_link(alpha: float) -> None:
    """With a 200 ms round trip the verifier decodes on while each draft travels (the real fill
    policy decides); the requests commit exactly their tokens (a fill past a request's end, or
    counted twice, would show), and they end sooner."""
    filled, plain = fill_run(alpha, True), fill_run(alpha, False)
    assert filled.requests_done == plain.requests_done == 3
    assert filled.committed == plain.committed == 3 * 40
    assert filled.filled > 0 and plain.filled == 0
    assert filled.latency_s is not None and plain.latency_s is not None
    assert filled.latency_s < plain.latency_s / 2


@pytest.mark.parametrize(("oks", "verified", "drafted", "accepted"), [
    ((True, True, False), 1, 3, 2),  # agreed with both filled tokens: the third is verified
    ((True, False, True), 0, 2, 1),  # left the fill at its second token: nothing verified
    ((True,), 0, 1, 1),  # ran out inside the fill
])
def test_the_simulated_verifier_settles_a_filled_rounds_draft_as_the_real_one_does(
        oks: tuple[bool, ...], verified: int, drafted: int, accepted: int) -> None:
    """Two tokens filled, then the draft arrives (the same cases as the real verifier's table in
    test_verifier_fill)."""
    sim = Simulation(SimSpec(drafters=(DrafterSpec("d", max_tokens=50),), cost=H100, rounds=1,
                             verifier=VerifierSpec(fill=True)))
    s = Session("x", sim.edges[0], 16, 50, None, 0.0, None, generated=2, cached=17, waiting_draft=True,
                filled=2, drafts=[(0.9, ok) for ok in oks])
    sim.verifier.take_draft(s, 0.0)
    assert len(s.drafts) == verified and "x" in sim.verifier.ready
    _, d, a, _ = sim.verifier._judge(s)
    assert (d, a) == (drafted, accepted)
    assert s.generated == 2 + (accepted - s.matched) + 1 and s.cached == s.context_len - 1


@pytest.mark.parametrize(("alpha", "all_accepted"), [(1.0, True), (0.0, False)])
def test_a_filled_rounds_draft_is_matched_against_the_fill(alpha: float, all_accepted: bool) -> None:
    """A perfect draft agrees with every filled token (they count as accepted drafts); a hopeless
    one leaves the fill at its first token, one rejected draft and nothing verified after it
    (three requests, 200 ms RTT: every round after a request's first is filled)."""
    r = fill_run(alpha, True)
    assert r.drafted > 0
    if all_accepted:
        assert r.accepted == r.drafted
    else:
        # a first round is not filled and drafts its whole budget (4); each later one leaves the fill at once
        assert r.accepted == 0 and r.drafted <= (r.rounds - 3) + 3 * 4


def test_goodput_grows_with_alpha() -> None:
    goodputs = [run([a] * 4, rounds=60).goodput_tok_s for a in (0.1, 0.5, 0.9)]
    assert goodputs[0] < goodputs[1] < goodputs[2]


def test_requests_finish_in_a_closed_loop() -> None:
    r = run([0.7, 0.7], rounds=60)
    assert r.requests_done >= 2
    assert r.latency_s is not None and r.ttft_s is not None and 0 < r.ttft_s < r.latency_s


def test_open_loop_arrivals_run_to_completion() -> None:
    fleet = (DrafterSpec("a", arrivals=(0.0, 0.05, 0.2), max_tokens=10), DrafterSpec("b", arrivals=(0.1,)))
    r = simulate(SimSpec(drafters=fleet, cost=H100, rounds=10_000))  # unreachable: stops when all are done
    assert r.requests_done == 4
    assert r.committed == 3 * 10 + 32


def test_a_shared_pool_lets_the_faster_drafter_serve_more() -> None:
    """Closed loop through one queue: the pool's size in all, the fast drafter takes most of it."""
    fleet = (DrafterSpec("fast", alpha=0.9, token_s=1e-4, rtt_s=0.0, max_tokens=20),
             DrafterSpec("slow", alpha=0.9, token_s=1e-4, rtt_s=0.2, max_tokens=20))
    r = simulate(SimSpec(drafters=fleet, cost=H100, rounds=None, duration_s=3600.0, shared_requests=12))
    assert r.requests_done == 12
    assert r.per_drafter_tok_s[0] > 2 * r.per_drafter_tok_s[1]
    own = simulate(SimSpec(drafters=tuple(replace(d, requests=6) for d in fleet), cost=H100, rounds=None,
                           duration_s=3600.0))
    assert own.requests_done == 12 and own.per_drafter_tok_s[0] < r.per_drafter_tok_s[0]


def test_shared_pool_is_closed_loop_only() -> None:
    with pytest.raises(ValueError, match="closed loop"):
        SimSpec(drafters=(DrafterSpec("a", arrivals=(0.0,)),), shared_requests=3)
    with pytest.raises(ValueError, match=">= 0"):
        SimSpec(drafters=(DrafterSpec("a"),), shared_requests=-1)


# --- the real policies ----------------------------------------------------------------------------


@pytest.mark.parametrize(("allocation", "capacity", "bound"), [
    ("goodspeed", 6, 6), ("random", 6, 6), ("fixed", 0, 4 * 5), ("goodspeed", 0, 4 * 5), ("smartspec", 0, 8 * 5),
])
def test_allocators_run_and_respect_capacity(allocation: str, capacity: int, bound: int) -> None:
    policies = Policies(allocation=allocation, capacity=capacity, draft_len=4)
    r = run([0.2, 0.4, 0.6, 0.8, 0.9], policies=policies)
    assert r.rounds >= 5 * 40
    assert 0 < r.max_budget_sum <= bound
    assert r.assign_ms_mean > 0


def test_goodspeed_gives_less_to_the_weaker_drafters_under_a_tight_budget() -> None:
    r = run([0.1, 0.9], policies=Policies(allocation="goodspeed", capacity=4), rounds=80)
    assert r.max_budget_sum <= 4
    assert r.per_drafter_tok_s[1] > r.per_drafter_tok_s[0]


@pytest.mark.parametrize("controller", ["fixed", "threshold", "adaspec", "wisp"])
def test_controllers_run(controller: str) -> None:
    r = run([0.3, 0.8], policies=Policies(controller=controller))
    assert r.rounds >= 80 and r.drafted > 0


def test_threshold_controller_stops_early_on_low_confidence() -> None:
    fixed = run([0.3] * 3, policies=Policies(controller="fixed", draft_len=8))
    threshold = run([0.3] * 3, policies=Policies(controller="threshold", draft_len=8))
    assert threshold.drafted / threshold.rounds < 0.5 * fixed.drafted / fixed.rounds


@pytest.mark.parametrize("batching", ["fcfs", "wisp"])
def test_batchers_respect_limits_and_report_slo(batching: str) -> None:
    fleet = make_fleet([0.6] * 6, DrafterSpec("d", max_tokens=8, slo_tokens_per_s=20.0))
    base = SimSpec(drafters=fleet, policies=Policies(batching=batching), cost=H100, rounds=30)
    r = simulate(replace(base, verifier=replace(base.verifier, max_sessions=2)))
    assert r.mean_batch is not None and r.mean_batch <= 2
    assert set(r.slo_attainment) == {"20"}
    assert 0.0 <= r.slo_attainment["20"] <= 1.0


# --- cost models ----------------------------------------------------------------------------------


#: this machine's profiled coefficients (.specfleet/verifier-profile.json, 2026-11: the demo target, one thread)
CPU_PROFILE = (1.5826734531009881e-04, 1.5016570833977112e-07, 1.4721890480494294e-06, 7.672583324883381e-03)


@pytest.mark.parametrize(("sessions", "new", "cached"), [(1, 1, 64), (8, 5, 512), (64, 5, 2048), (256, 5, 128)])
def test_h100_is_faster_than_the_cpu_estimator(sessions: int, new: int, cached: int) -> None:
    """The H100 projection of an 8B target beats this CPU's profile (a 4 M-parameter demo target)."""
    shapes = [SegmentShape(new=new, cached=cached)] * sessions
    assert H100Cost().predict(shapes) < StepTimeEstimator(CPU_PROFILE).predict(shapes)


def test_cpu_cost_reads_the_profile(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    StepTimeEstimator(CPU_PROFILE).save(path)
    assert load_cpu_coef(path) == pytest.approx(CPU_PROFILE)
    with pytest.warns(UserWarning, match="DEFAULT_COEF"):
        assert load_cpu_coef(tmp_path / "missing.json") == DEFAULT_COEF


@pytest.mark.parametrize("kind", ["cpu", "h100"])
def test_cost_scale_multiplies_every_prediction(kind: str) -> None:
    shapes = [SegmentShape(new=5, cached=100)] * 4
    base, scaled = CostSpec(kind, CPU_PROFILE).build(), CostSpec(kind, CPU_PROFILE, scale=1.5).build()
    assert scaled.predict(shapes) == pytest.approx(1.5 * base.predict(shapes))
    assert scaled.predict_sums(20, 2100, 400) == pytest.approx(1.5 * base.predict_sums(20, 2100, 400))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="scale"):
            CostSpec(kind, scale=bad).build()


def test_h100_is_monotone_in_tokens() -> None:
    h = H100Cost()
    by_new = [h.predict([SegmentShape(new=n, cached=256)] * 32) for n in (1, 2, 5, 17, 65, 257)]
    by_cached = [h.predict([SegmentShape(new=5, cached=c)] * 32) for c in (0, 100, 1000, 10_000, 100_000)]
    assert by_new == sorted(by_new) and by_new[0] < by_new[-1]
    assert by_cached == sorted(by_cached) and by_cached[0] < by_cached[-1]


def test_h100_roofline_regimes() -> None:
    h = H100Cost()
    one = h.predict([SegmentShape(new=1, cached=0)])
    assert one == pytest.approx(8.03e9 * 2 / 3.35e12 + 1e-3, rel=0.01)  # weights once + launch
    assert h.predict_sums(5, 5 * 105, 100) == pytest.approx(h.predict([SegmentShape(new=5, cached=100)]))


# --- acceptance model ------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8])
def test_acceptance_probabilities_have_mean_alpha(alpha: float) -> None:
    rng = random.Random(1)
    draws = [acceptance_prob(rng, alpha, 4.0) for _ in range(20_000)]
    assert sum(draws) / len(draws) == pytest.approx(alpha, abs=0.01)


def test_features_follow_confidence() -> None:
    grid = [i / 20 for i in range(1, 20)]
    steps = [features(a, 0, 4) for a in grid]
    assert [s.top1_prob for s in steps] == sorted(s.top1_prob for s in steps)
    assert [s.spread.entropy for s in steps] == sorted((s.spread.entropy for s in steps), reverse=True)
    assert all(0 <= s.top2_prob <= s.top1_prob <= 1 for s in steps)


@pytest.mark.parametrize(("bits", "want"), [([], 0), ([False, True], 0), ([True, True, False, True], 2),
                                            ([True] * 3, 3)])
def test_accepted_prefix(bits: list[bool], want: int) -> None:
    assert accepted_prefix(bits) == want


# --- metrics, spec, determinism ----------------------------------------------------------------------


def test_parse_alphas() -> None:
    assert parse_alphas("spread", 3) == pytest.approx([0.3, 0.6, 0.9])
    assert parse_alphas("0.5,0.9", 3) == [0.5, 0.9, 0.5]
    assert parse_alphas("spread:0.2:0.4", 2) == pytest.approx([0.2, 0.4])


def test_spec_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="alpha"):
        DrafterSpec("x", alpha=1.5)
    with pytest.raises(ValueError, match="proposal_rate"):
        DrafterSpec("x", proposal_rate=-0.1)
    with pytest.raises(ValueError, match="bound"):
        SimSpec(drafters=(DrafterSpec("x"),), rounds=None)


def test_deterministic_for_a_seed() -> None:
    s = spec([0.3, 0.6, 0.9], policies=Policies(allocation="random", controller="adaspec", batching="wisp"))
    a, b = simulate(s), simulate(s)
    assert a.deterministic() == b.deterministic()
    assert simulate(replace(s, seed=1)).deterministic() != a.deterministic()


def test_duration_bounds_the_run() -> None:
    r = run([0.7] * 3, rounds=None, duration_s=0.05)
    assert r.sim_s == pytest.approx(0.05)
    assert r.rounds > 0


# --- CLI --------------------------------------------------------------------------------------------


def test_cli_end_to_end(tmp_path: Path) -> None:
    """The CLI on an explicit profile, so the run never depends on this checkout's `.specfleet/`."""
    out, profile = tmp_path / "sim", tmp_path / "profile.json"
    StepTimeEstimator(CPU_PROFILE).save(profile)
    code = main(["--drafters", "3,6", "--rounds", "6", "--allocation", "goodspeed", "--alphas", "spread",
                 "--rtt-ms", "spread:10:50", "--target-only", "--no-progress", "--out", str(out),
                 "--estimator-file", str(profile)])
    assert code == 0
    doc = json.loads((out / "sim.json").read_text())
    assert len(doc["runs"]) == 2 * 2 * 2  # cost models x N x (speculative, target-only)
    assert {r["cost"] for r in doc["runs"]} == {"cpu", "h100"}
    table = (out / "sim.md").read_text()
    assert "| cpu | 6 |" in table and "| h100 | 3 |" in table
    assert (out / "sim.png").stat().st_size > 0


def test_cli_rejects_bad_values(tmp_path: Path) -> None:
    assert main(["--drafters", "2", "--alphas", "2.0", "--out", str(tmp_path)]) == 2


def rider_run(riders: bool) -> SimResult:
    """Three fast drafters keep the verifier busy while a slow one's drafts take 200 ms to come."""
    fast = tuple(DrafterSpec(f"fast{i}", alpha=0.9, rtt_s=0.0, token_s=1e-4, max_tokens=60, prompt_len=16, requests=3)
                 for i in range(3))
    fleet = (*fast, DrafterSpec("slow", alpha=0.9, rtt_s=0.2, max_tokens=60, prompt_len=16, requests=3))
    return simulate(SimSpec(drafters=fleet, cost=H100, rounds=None, duration_s=3600.0,
                            verifier=VerifierSpec(fill=True, riders=riders)))


def test_riders_decode_a_slow_drafters_session_in_steps_that_verify_others() -> None:
    """The real verifier's riders (``Fill.riders``): with them the slow drafter's session is
    decoded in the fast one's steps while its draft travels, so it is filled more and its requests
    end sooner; every request commits exactly its tokens either way."""
    with_riders, without = rider_run(True), rider_run(False)
    assert with_riders.requests_done == without.requests_done == 12
    assert with_riders.committed == without.committed == 12 * 60
    assert with_riders.filled > 1.4 * without.filled  # 252 against 160 when written
    assert with_riders.latency_s is not None and without.latency_s is not None
    assert with_riders.latency_s < without.latency_s
