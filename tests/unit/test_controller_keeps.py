"""``DraftController.keeps``: how much of a ready draft a controller would keep if its round
began now, without touching its state (it screens a conditional Draft sent while the round in
flight still owns the controller). It must agree with the round it stands in for: begin_round,
then on_step token by token."""

from __future__ import annotations

import copy

import pytest

from services.drafter.control import ControlSettings, make_controller
from services.drafter.control.base import DraftController, Spread, StepDecision, StepFeatures
from services.drafter.control.fixed import FixedController
from services.drafter.control.threshold import ThresholdController
from services.drafter.control.throughput import RoundClock, ThroughputState


def steps(*probs: float, rows: int = 1) -> list[StepFeatures]:
    return [StepFeatures(position=i, budget=len(probs), token_id=1, token_prob=p, top1_prob=p, top2_prob=0.0,
                         spread=Spread(entropy=0.1, logit_std=1.0), rows=rows) for i, p in enumerate(probs)]


def a_round(controller: DraftController, drafted: list[StepFeatures], budget: int) -> int:
    """Tokens a fresh round keeps of ``drafted``: the reference ``keeps`` must match."""
    k = controller.begin_round(budget)
    kept = 0
    for step in drafted[:k]:
        decision = controller.on_step(step)
        if decision is StepDecision.DISCARD:
            break
        kept += 1
        if decision is StepDecision.STOP:
            break
    return kept


def adaspec(history: list[tuple[list[float], int]], clock: RoundClock) -> DraftController:
    state = ThroughputState(clock=clock)
    for _ in range(50):
        for confs, accepted in history:
            state.calibration.observe(confs, accepted)
    return make_controller("adaspec", ControlSettings(adaspec=state))


def clock(draft_token_s: float, z0: float, z1: float) -> RoundClock:
    c = RoundClock(draft_token_s=draft_token_s)
    for j in (1, 2, 3, 4, 5, 6) * 10:
        c.observe(j, 0.0, z0 + z1 * j)
    c.draft_token_s = draft_token_s
    return c


CONFIDENT = [([0.95] * 6, 6)]
UNSURE = [([0.15] * 6, 0)]
FADING = [([0.95, 0.15, 0.15, 0.15], 1)]
HALF = [([0.95, 0.45], 1), ([0.95, 0.45], 2)]  # the second token accepted about half the time


@pytest.mark.parametrize(("make", "probs", "budget", "kept", "rows"), [
    (FixedController, (0.9, 0.1, 0.9), 3, 3, 1),
    (FixedController, (0.9, 0.1, 0.9), 2, 2, 1),
    (ThresholdController, (0.9, 0.3, 0.9), 3, 2, 1),  # keeps the unsure token, then stops
    (ThresholdController, (0.9, 0.8, 0.9), 3, 3, 1),
    (ThresholdController, (0.2,), 1, 1, 1),
    (lambda: adaspec(CONFIDENT, clock(0.0002, 0.01, 0.0)), (0.95,) * 6, 6, 6, 1),
    (lambda: adaspec(CONFIDENT, clock(0.0002, 0.01, 0.0)), (0.95,) * 6, 4, 4, 1),
    (lambda: adaspec(UNSURE, clock(0.002, 0.005, 0.001)), (0.15,) * 6, 6, 0, 1),  # its round would decline
    (lambda: adaspec(FADING, clock(0.002, 0.004, 0.0005)), (0.95, 0.15, 0.15, 0.15), 4, 1, 1),
    (lambda: make_controller("adaspec", ControlSettings()), (0.01, 0.01), 2, 2, 1),  # unmeasured: the budget
    (FixedController, (), 4, 0, 1),
    (lambda: adaspec(HALF, clock(0.004, 0.006, 0.0)), (0.95, 0.45, 0.45), 3, 1, 1),  # alone: one token
    (lambda: adaspec(HALF, clock(0.004, 0.006, 0.0)), (0.95, 0.45, 0.45), 3, 3, 10),  # a tenth of a step each
])
def test_keeps_agrees_with_a_round(make: object, probs: tuple[float, ...], budget: int, kept: int, rows: int) -> None:
    controller: DraftController = make()  # type: ignore[operator]
    screened = controller.keeps(steps(*probs, rows=rows), budget)
    assert screened == kept
    assert a_round(copy.deepcopy(controller), steps(*probs, rows=rows), budget) == kept


def test_keeps_changes_no_state() -> None:
    controller = adaspec(FADING, clock(0.002, 0.004, 0.0005))
    before = copy.deepcopy(controller.__dict__)
    state = controller.shared  # type: ignore[attr-defined]
    shared = (copy.deepcopy(state.calibration), copy.deepcopy(state.clock), state.declined)
    for _ in range(10):
        controller.keeps(steps(0.95, 0.15, 0.15), 3)
    assert repr(controller.__dict__) == repr(before)
    assert (state.calibration, state.clock, state.declined) == shared
