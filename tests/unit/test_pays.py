"""The verifier's measured guard (``allocation/pays.py``): speculation switched off at a load where the
tokens served per second fell below target-only's rate for the same sessions, tried again after a
hold that doubles while the tries fail; the wrapped policy decides otherwise."""

from __future__ import annotations

import math

import pytest

from services.verifier.allocation import GoodputTracker, PerDrafterAllocator, RoundStats, SmartSpecAllocator
from services.verifier.allocation.pays import BASELINE_RANGE, HOLD_S, MAX_HOLD_S, WINDOW_S, PaysGuard, pays
from services.verifier.batching.estimator import SegmentShape, StepTimeEstimator
from services.verifier.config import VerifierConfig
from services.verifier.main import make_allocator_for
from shared.config import from_flags
from tests.unit.test_drafting_switch import Clock

STEP_S = 0.04  # target-only's step, whatever the sessions (the tests' T0)


@pytest.mark.parametrize(("tokens", "seconds", "sessions", "step_s", "ratio"), [
    (25, 1.0, 1.0, 0.04, 1.0),  # one session at target-only's pace
    (50, 1.0, 1.0, 0.04, 2.0),  # twice as many tokens: speculation doubled it
    (100, 1.0, 4.0, 0.04, 1.0),  # four sessions, one token each a step
    (50, 1.0, 4.0, 0.04, 0.5),
    (30, 2.0, 1.0, 0.08, 1.2),
])
def test_the_ratio_is_served_over_target_onlys_rate(tokens: int, seconds: float, sessions: float, step_s: float,
                                                    ratio: float) -> None:
    assert pays(tokens, seconds, sessions, step_s) == pytest.approx(ratio)


@pytest.mark.parametrize(("seconds", "sessions", "step_s"), [(0.0, 1.0, 0.04), (1.0, 0.0, 0.04), (1.0, 1.0, 0.0)])
def test_a_degenerate_window_has_no_ratio(seconds: float, sessions: float, step_s: float) -> None:
    assert math.isnan(pays(10, seconds, sessions, step_s))


class Inner:
    """A policy that always wants 4 tokens and every request drafted for."""

    name = "inner"
    last_k, last_goodput = 4, 123.0

    def initial(self, session_id: str, tracker: GoodputTracker) -> int:
        return 4

    def assign(self, rounds: list[RoundStats], tracker: GoodputTracker) -> dict[str, int]:
        return {r.session_id: 4 for r in rounds}

    def draft_share(self, tracker: GoodputTracker) -> float:
        return 1.0

    def beliefs(self) -> dict[str, float]:
        return {"alpha": 0.9}


def guard(clock: Clock, step_s: float | None = STEP_S) -> PaysGuard:
    return PaysGuard(Inner(), lambda sessions, context: step_s, clock=clock)


def serve(g: PaysGuard, clock: Clock, seconds: float, sessions: int, speedup: float, dt: float = STEP_S) -> None:
    """Steps of ``dt`` with ``sessions`` live, committing ``speedup`` times target-only's tokens."""
    owed = 0.0  # tokens carried to the next step, so that any speedup is served exactly on average
    for _ in range(round(seconds / dt)):
        clock.now += dt
        owed += sessions * speedup * dt / STEP_S
        g.served(sessions, int(owed), 100.0)
        owed -= int(owed)


def rounds(*ids: str) -> list[RoundStats]:
    return [RoundStats(sid, "d", 4, 2, 50) for sid in ids]


def test_speculation_that_pays_stays_on_and_the_policy_decides() -> None:
    clock, tracker = Clock(), GoodputTracker()
    g = guard(clock)
    serve(g, clock, 10.0, 1, 2.0)
    assert g.on and g.assign(rounds("a"), tracker) == {"a": 4} and g.initial("a", tracker) == 4
    assert g.draft_share(tracker) == 1.0 and g.last_k == 4 and g.last_goodput == 123.0
    assert g.beliefs()["pays_ratio_band1"] == pytest.approx(2.0) and g.beliefs()["alpha"] == 0.9


def test_speculation_that_loses_is_switched_off_for_a_hold_then_tried_again() -> None:
    clock, tracker = Clock(), GoodputTracker()
    g = guard(clock)
    serve(g, clock, 3.0, 4, 0.6)
    assert not g.on
    assert g.assign(rounds("a", "b"), tracker) == {"a": 0, "b": 0}  # every session decodes target-only
    assert g.initial("c", tracker) == 0 and g.draft_share(tracker) == 0.0 and g.last_k == 0
    off = g.beliefs()["pays_off_left_s_band3"]
    assert 0 < off <= HOLD_S
    serve(g, clock, off + 0.1, 4, 1.0)  # the hold: target-only serving, nothing judged
    assert g.on and g.bands[3].switched_off == 1


@pytest.mark.parametrize(("target_only", "scale", "speculative", "back_on"), [
    (0.625, 0.625, 0.75, True),  # target-only serving reaches 0.625 of the model: 0.75 of it pays 1.2x
    (1.0, 1.0, 0.75, False),  # it reaches the model's rate: 0.75 loses
    (0.25, BASELINE_RANGE[0], 0.5, False),  # 0.25 is held at the floor: 0.5 / 0.6 loses (0.5 / 0.25 would not)
])
def test_verdicts_compare_with_target_only_serving_as_measured_while_off(target_only: float, scale: float,
                                                                        speculative: float, back_on: bool) -> None:
    """While a band is off its target-only serving is measured against the model, and later
    verdicts there divide by it; the first window after each switch is not used."""
    clock = Clock()
    g = guard(clock)
    serve(g, clock, 3.0, 4, speculative)
    assert not g.on and g.beliefs()["pays_baseline_band3"] == 1.0  # judged on the model alone
    serve(g, clock, g.bands[3].off_until - clock.now + 0.1, 4, target_only)  # the hold: target-only
    assert g.on and g.bands[3].baseline == pytest.approx(target_only, rel=0.1)
    assert g.beliefs()["pays_baseline_band3"] == pytest.approx(scale, rel=0.03)
    serve(g, clock, 5.2, 4, speculative)  # the window that straddles the switch, then one judged
    assert g.on == back_on
    assert g.bands[3].ratio == pytest.approx(speculative / scale, rel=0.03)


def test_a_baseline_is_filed_under_the_band_its_window_served_and_not_from_a_ramp() -> None:
    clock = Clock()
    g = guard(clock)
    serve(g, clock, 3.0, 2, 0.5)  # band 2 (2-3 sessions) loses: it and every band above are off
    assert not g.on_at(2) and not g.on_at(5)
    serve(g, clock, 5.1, 5, 0.75)  # target-only at 5 sessions (band 3) while band 2's hold runs
    assert 3 in g.bands and g.bands[3].baseline == pytest.approx(0.75, rel=0.03)
    assert g.bands[2].baseline != g.bands[2].baseline  # nothing measured at 2-3 sessions
    for sessions in [4, 8] * 40:  # a load swinging across bands 3 and 4: no window of either
        clock.now += STEP_S
        g.served(sessions, sessions, 100.0)
    assert 4 not in g.bands and g.bands[3].baseline == pytest.approx(0.75, rel=0.03)


def test_the_hold_doubles_while_tries_fail_up_to_its_cap_and_halves_after_one_that_paid() -> None:
    clock = Clock()
    g = guard(clock)
    holds = []
    for _ in range(6):
        # a window of 2.5 s, judged 0.04 s before the end; after a hold, the one before it is not used
        serve(g, clock, 5.1 if holds else 2.6, 4, 0.5)
        assert not g.on
        holds.append(g.bands[3].off_until - clock.now)
        clock.now = g.bands[3].off_until
    assert holds == pytest.approx([HOLD_S, 2 * HOLD_S, 4 * HOLD_S, MAX_HOLD_S, MAX_HOLD_S, MAX_HOLD_S], abs=0.1)
    serve(g, clock, 5.1, 4, 1.5)
    assert g.on and g.bands[3].next_hold_s == MAX_HOLD_S / 2


def test_a_load_band_switched_off_switches_off_the_higher_ones_not_the_lower() -> None:
    clock, tracker = Clock(), GoodputTracker()
    g = guard(clock)
    serve(g, clock, 3.0, 5, 0.5)  # 4-7 sessions: band 3
    assert not g.on and not g.on_at(5) and not g.on_at(20)
    assert g.on_at(1) and g.on_at(3)
    serve(g, clock, 4.0, 1, 2.0)  # the load falls to one session: its moving average follows
    assert g.load == pytest.approx(1.0, abs=0.1) and g.on and g.draft_share(tracker) == 1.0


def test_an_idle_verifier_is_on_for_the_next_request_whatever_the_last_burst_was() -> None:
    clock, tracker = Clock(), GoodputTracker()
    g = guard(clock)
    serve(g, clock, 3.0, 16, 0.5)
    assert not g.on and g.draft_share(tracker) == 0.0
    clock.now += 2.0  # the burst is over: no step since
    assert g.on and g.draft_share(tracker) == 1.0
    serve(g, clock, 0.2, 16, 0.5)  # the next burst: its load is still switched off
    assert not g.on


def test_an_idle_gap_starts_the_window_afresh() -> None:
    clock = Clock()
    g = guard(clock)
    serve(g, clock, 2.0, 2, 0.5)
    clock.now += 5.0  # no session: the verifier idled
    serve(g, clock, 2.0, 2, 0.5)
    assert g.on and not g.bands  # neither part held a whole window
    serve(g, clock, 1.0, 2, 0.5)
    assert not g.on


@pytest.mark.parametrize(("speedups", "on"), [
    ([1.3, 1.3, 0.94], True),  # a dip after windows that paid: their average holds
    ([1.3, 0.9, 0.8], False),  # a lasting drop: the average falls below 1 on its second window
    ([0.94], False),  # the first window since it came on decides alone
    ([1.1, 1.3, 1.3, 0.6], False),  # a dip deep enough outweighs them
])
def test_a_verdict_reads_the_windows_since_speculation_came_on_averaged(speedups: list[float], on: bool) -> None:
    clock = Clock()
    g = guard(clock)
    for speedup in speedups:
        serve(g, clock, WINDOW_S + STEP_S, 4, speedup)
    assert g.on == on
    assert g.bands[3].ratio == pytest.approx(speedups[-1], rel=0.05)  # windows and calls need not align


def test_after_a_hold_the_first_window_decides_alone() -> None:
    clock = Clock()
    g = guard(clock)
    serve(g, clock, WINDOW_S + STEP_S, 4, 0.8)
    assert not g.on
    serve(g, clock, HOLD_S + STEP_S, 4, 1.0)  # the hold, target-only
    serve(g, clock, 2 * (WINDOW_S + STEP_S), 4, 1.1)  # the window straddling the switch, then one that pays
    assert g.on and g.bands[3].running == pytest.approx(1.1, rel=0.03)


@pytest.mark.parametrize(("start", "end", "judged"), [(1, 4, False), (16, 64, False), (64, 16, False), (8, 2, False),
                                                       (2, 4, True), (12, 16, True), (16, 15, True), (16, 16, True)])
def test_a_window_in_which_the_load_moved_two_bands_is_not_judged(start: int, end: int, judged: bool) -> None:
    """A burst's ramp (its prefills, its first rounds) or drain reads low whatever serves it; a steady
    load, or one that moved within a band or into the next, is judged."""
    clock = Clock()
    g = guard(clock)
    steps = round(WINDOW_S / STEP_S) + 2
    for i in range(steps):
        clock.now += STEP_S
        sessions = start + (end - start) * i // (steps - 1)
        g.served(sessions, round(sessions * 0.5), 100.0)  # half target-only's rate: a loss if judged
    assert (not g.on_at(max(start, end))) == judged
    assert bool(g.bands) == judged


def test_without_target_onlys_step_nothing_is_judged() -> None:
    clock = Clock()
    g = guard(clock, step_s=None)
    serve(g, clock, 10.0, 4, 0.2)
    assert g.on and not g.bands


def test_the_verifier_guards_smartspec_by_default_and_not_when_asked() -> None:
    est = StepTimeEstimator()
    guarded = make_allocator_for(from_flags(VerifierConfig), est)
    assert isinstance(guarded, PaysGuard) and isinstance(guarded.inner, PerDrafterAllocator)
    assert guarded.name == "smartspec-per-drafter"
    alone = make_allocator_for(from_flags(VerifierConfig, speculation_guard=False), est)
    assert isinstance(alone, PerDrafterAllocator)
    fixed = make_allocator_for(from_flags(VerifierConfig, allocation="fixed"), est)
    assert not isinstance(fixed, PaysGuard)
    single = make_allocator_for(from_flags(VerifierConfig, allocation="smartspec"), est)
    assert isinstance(single, PaysGuard) and isinstance(single.inner, SmartSpecAllocator)
    vllm = make_allocator_for(from_flags(VerifierConfig, backend="vllm"), est)  # its core feeds no guard
    assert isinstance(vllm, PerDrafterAllocator)


def test_the_verifier_prices_target_only_with_its_measured_forwards_and_busy_time() -> None:
    est = StepTimeEstimator()
    g = make_allocator_for(from_flags(VerifierConfig), est)
    assert isinstance(g, PaysGuard)
    assert g.target_only(4, 100) is None  # no target-only forward measured yet
    for cached in (50, 150):
        est.target_only.observe([SegmentShape(1, cached)] * 4, 0.030 + 0.0001 * (cached - 100))
    for n in (1, 8):
        est.overhead.observe(n, 0.002)
    assert g.target_only(4, 100) == pytest.approx(0.032, abs=1e-4)
