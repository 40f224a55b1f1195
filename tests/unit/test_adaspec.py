"""AdaSpec's adaptive drafter: the efficiency model, its estimators, and the stop rule."""

from __future__ import annotations

import pytest

from services.drafter.control import ControlSettings, make_controller
from services.drafter.control.base import Spread, StepDecision, StepFeatures
from services.drafter.control.throughput import PROBE_EVERY, Calibration, RoundClock, ThroughputState, efficiency


def _clock(draft_token_s: float, z0: float, z1: float) -> RoundClock:
    clock = RoundClock()
    for _ in range(200):
        for j in (1, 3, 5):
            clock.observe(j, j * draft_token_s, z0 + z1 * j)
    return clock


def test_clock_fits_the_return_time_line() -> None:
    clock = _clock(0.001, 0.006, 0.0005)
    z0, z1 = clock.line()
    assert clock.draft_token_s == pytest.approx(0.001)
    assert (z0, z1) == (pytest.approx(0.006), pytest.approx(0.0005))
    assert clock.round_time(4) == pytest.approx(4 * 0.001 + 0.006 + 4 * 0.0005)


def test_rounds_drafted_ahead_cost_no_drafting_time() -> None:
    """A round whose draft a lookahead had ready waited for no drafting (draft_s = 0): the clock
    charges what rounds wait for, so half the rounds ready halves the time per draft token."""
    clock = RoundClock()
    clock.observe(4, 0.0, 0.01)  # ready before anything was measured: still unmeasured
    assert clock.draft_token_s == 0.0
    for _ in range(400):
        clock.observe(4, 0.004, 0.01)
        clock.observe(4, 0.0, 0.01)
    assert clock.draft_token_s == pytest.approx(0.0005, rel=0.1)


def test_clock_with_one_draft_length_is_flat() -> None:
    clock = RoundClock()
    for _ in range(10):
        clock.observe(4, 0.004, 0.01)
    assert clock.line() == (pytest.approx(0.01), 0.0)


@pytest.mark.parametrize(("alphas", "expected_tokens"), [([], 1.0), ([1.0], 2.0), ([0.5], 1.5), ([0.5, 0.5], 1.75),
                                                         ([0.8, 0.5, 0.0], 1 + 0.8 + 0.4)])
def test_efficiency_is_expected_tokens_over_expected_time(alphas: list[float], expected_tokens: float) -> None:
    clock = _clock(0.001, 0.01, 0.0)
    assert efficiency(alphas, clock) == pytest.approx(expected_tokens / clock.round_time(len(alphas)))


def test_calibration_learns_from_judged_drafts_only() -> None:
    cal = Calibration()
    before = list(cal.rate)
    cal.observe([0.95, 0.85, 0.15, 0.55], accepted=2)  # 0, 1 accepted; 2 rejected; 3 never judged
    assert cal.rate[9] > before[9] and cal.rate[8] > before[8] and cal.rate[1] < before[1]
    assert cal.rate[5] == before[5]
    assert cal.predicted_confidence(0) == 0.95 and cal.predicted_confidence(10) == 0.55


def _step(position: int, prob: float) -> StepFeatures:
    return StepFeatures(position=position, budget=8, token_id=1, token_prob=prob, top1_prob=prob, top2_prob=0.0,
                        spread=Spread(entropy=0.1))


def _controller(clock: RoundClock, confident: bool) -> tuple[object, ThroughputState]:
    state = ThroughputState(clock=clock)
    for _ in range(50):  # history: confident drafts get accepted, unsure ones do not
        conf = 0.95 if confident else 0.15
        state.calibration.observe([conf] * 6, accepted=6 if confident else 0)
    return make_controller("adaspec", ControlSettings(adaspec=state)), state


def test_cheap_confident_drafting_spends_the_budget() -> None:
    controller, _ = _controller(_clock(0.0002, 0.01, 0.0), confident=True)
    assert controller.begin_round(6) == 6  # type: ignore[attr-defined]
    decisions = [controller.on_step(_step(i, 0.95)) for i in range(6)]  # type: ignore[attr-defined]
    assert all(d is StepDecision.CONTINUE for d in decisions)


def test_unsure_drafting_stops_at_once() -> None:
    controller, _ = _controller(_clock(0.002, 0.005, 0.001), confident=False)
    assert controller.begin_round(6) == 0  # type: ignore[attr-defined]


def test_a_drop_in_confidence_stops_the_round() -> None:
    """Predict from history (confident), execute, correct: the actual token is unsure, and the
    next one is predicted no better than history says, so one more would lower E/T."""
    clock = _clock(0.002, 0.004, 0.0005)
    state = ThroughputState(clock=clock)
    for _ in range(50):
        state.calibration.observe([0.95, 0.15, 0.15, 0.15], accepted=1)
    controller = make_controller("adaspec", ControlSettings(adaspec=state))
    assert controller.begin_round(4) == 4
    assert controller.on_step(_step(0, 0.95)) is StepDecision.STOP  # the next position is historically unsure


def test_an_unmeasured_drafter_drafts_the_budget() -> None:
    controller = make_controller("adaspec", ControlSettings())
    assert controller.begin_round(5) == 5
    assert controller.on_step(_step(0, 0.01)) is StepDecision.CONTINUE


def test_a_controller_that_declines_probes_with_one_token_now_and_then() -> None:
    """Declined rounds teach nothing; every PROBE_EVERY-th decline drafts one token instead, and
    a probe whose token is accepted confidently lets drafting resume."""
    controller, state = _controller(_clock(0.002, 0.005, 0.001), confident=False)
    ks = [controller.begin_round(6) for _ in range(2 * PROBE_EVERY)]  # type: ignore[attr-defined]
    assert ks == ([0] * (PROBE_EVERY - 1) + [1]) * 2
    for _ in range(200):  # the probes come back accepted with high confidence: history changes
        state.calibration.observe([0.95], accepted=1)
    assert controller.begin_round(6) == 6  # type: ignore[attr-defined]
    assert state.declined == 0


@pytest.mark.parametrize(("rows", "decision"), [(1, StepDecision.STOP), (2, StepDecision.CONTINUE),
                                                (10, StepDecision.CONTINUE)])
def test_a_session_drafting_in_a_batch_pays_its_share_of_a_step(rows: int, decision: StepDecision) -> None:
    """Drafting costs 4 ms a token and the return 6 ms: alone, a second token accepted about half
    the time lowers E/T (2.5 / 14 ms < 2 / 10 ms); in a batch of two sessions that draft on it costs
    2 ms of the step (2.5 / 12 ms), in one of ten 0.4 ms, and raises it."""
    state = ThroughputState(clock=_clock(0.004, 0.006, 0.0))
    for i in range(200):
        state.calibration.observe([0.95, 0.45], accepted=2 if i % 2 else 1)
    controller = make_controller("adaspec", ControlSettings(adaspec=state))
    assert controller.begin_round(4) == 4
    step = StepFeatures(position=0, budget=4, token_id=1, token_prob=0.95, top1_prob=0.95, top2_prob=0.0, rows=rows)
    assert controller.on_step(step) is decision
