"""SmartSpec's draft waits: a level per load band under one slope in the draft's length."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.verifier.allocation import GoodputTracker, RoundStats, SmartSpecAllocator
from services.verifier.allocation.draft_wait import BAND_MIN, BAND_WINDOW, DraftWaitModel, band
from services.verifier.allocation.smartspec import best_length
from tests.unit.test_allocation import Linear
from tests.unit.test_drafting_switch import Clock


@pytest.mark.parametrize(("sessions", "want"), [(0, 0), (1, 1), (2, 2), (3, 2), (4, 3), (7, 3), (8, 4), (40, 6),
                                                (64, 7), (2.9, 2)])
def test_load_bands_are_powers_of_two(sessions: float, want: int) -> None:
    assert band(sessions) == want


def waits(points: Sequence[tuple[float, float, float]]) -> DraftWaitModel:
    wait = DraftWaitModel(refit_every=1)
    for k, y, n in points:
        wait.observe(k, y, n)
    return wait


def test_each_band_has_its_level_under_one_slope() -> None:
    """2 ms + 1 ms per token at 2 sessions, 20 ms + 1 ms per token at 40."""
    wait = waits([(k, 0.002 + 0.001 * k, 2) for k in (2, 4)] * 4 + [(k, 0.020 + 0.001 * k, 40) for k in (2, 4)] * 4)
    assert wait.fit[0] == pytest.approx(0.001)
    assert wait.fit[1] == pytest.approx({2: 0.002, 6: 0.020})
    assert wait.predict(4, 3) == pytest.approx(0.006) and wait.predict(4, 33) == pytest.approx(0.024)
    assert wait.predict(4, 1) == pytest.approx(0.006)  # no band of its own: the nearest
    assert wait.predict(4, 12) == pytest.approx(0.006)  # equally near both: the lighter load's
    assert wait.predict(4) == pytest.approx(wait.e0 + 0.004)  # over every load: the line
    assert wait.predict(0, 40) == 0.0


def test_a_band_with_too_few_rounds_has_no_level() -> None:
    wait = waits([(4, 0.005, 2)] * BAND_MIN + [(4, 0.050, 40)] * (BAND_MIN - 1))
    assert set(wait.fit[1]) == {2}
    assert wait.predict(4, 40) == pytest.approx(0.005)


def test_the_slope_is_the_lengths_within_a_band_not_the_loads() -> None:
    """SmartSpec drafts 2 tokens alone and 5 in a burst: across bands the wait's rise from 6 to
    30 ms would read as 8 ms per token, and price a lone 2-token draft at 16 ms; within each
    band the length never moves, so the slope is 0 and each band keeps its own wait."""
    wait = waits([(2, 0.006, 1)] * 20 + [(5, 0.030, 40)] * 20)
    assert wait.e1 == pytest.approx(0.008)  # the line over every load takes the load for the length
    assert wait.fit == (0.0, pytest.approx({1: 0.006, 6: 0.030}))
    assert wait.predict(2, 1) == pytest.approx(0.006) and wait.predict(5, 1) == pytest.approx(0.006)


def test_a_long_burst_does_not_push_the_light_loads_rounds_out() -> None:
    """Ten steps of 40 sessions (400 rounds) after ten of 2: the line keeps the last 256 rounds,
    all the burst's; the light band keeps its own last BAND_WINDOW."""
    wait = waits([(5, 0.006, 2)] * 20 + [(5, 0.030, 40)] * 400)
    assert all(y == 0.030 for _, y in wait.points)
    assert wait.fit[1] == pytest.approx({2: 0.006, 6: 0.030})
    assert wait.predict(5, 1) == pytest.approx(0.006)
    wait = waits([(5, 0.030, 40)] * (BAND_WINDOW + 10))
    assert len(wait._bands[6]) == BAND_WINDOW


def test_a_bands_rounds_expire_with_the_line() -> None:
    clock = Clock()
    wait = DraftWaitModel(refit_every=1, clock=clock)
    for _ in range(BAND_MIN):
        wait.observe(5, 0.030, 40)
    clock.now = 1.5
    for _ in range(BAND_MIN):
        wait.observe(5, 0.006, 2)
    clock.now = 2.5  # the burst's rounds are older than the 2 s horizon, the pair's are not
    wait.expire()
    assert set(wait._bands) == {2} and len(wait.points) == BAND_MIN
    wait.observe(5, 0.006, 2)  # a refit: only the pair's band is left
    assert wait.fit[1] == pytest.approx({2: 0.006})
    clock.now = 10.0
    wait.expire()
    assert not wait._bands and not wait.points and wait.fit == (0.0, {}) and wait.e0 == wait.e1 == 0.0


@pytest.mark.parametrize("bad", [(0, 0.01, 1), (4, -0.01, 1), (4, float("nan"), 1), (4, 0.01, float("inf")),
                                 (4, 0.01, -1)])
def test_what_is_not_a_drafted_round_is_ignored(bad: tuple[float, float, float]) -> None:
    assert not waits([bad]).points


def rounds(n: int, wait_s: float) -> list[RoundStats]:
    return [RoundStats(f"s{i}", "d", 5, 4, 200, 4.0, wait_s) for i in range(n)]


def tracker_with(n: int) -> GoodputTracker:
    t = GoodputTracker()
    for i in range(n):
        t.open(f"s{i}", "d")
    return t


@pytest.mark.parametrize("steps", [1, 10])
def test_a_bursts_long_waits_do_not_switch_a_lone_request_off(steps: int) -> None:
    """Bursts of 40 sessions waited 30 ms for each draft, the pairs between them 6 ms (``steps``
    steps of each in turn; with 10, a burst's 400 rounds fill the window of the line). Speculation
    pays in both (a busy verifier verifies others while a draft is made), and a request arriving
    to an idle verifier is priced at the pair's wait and gets a drafter. The same waits on one
    line average about 29 ms, which prices a lone request's drafting above plain decoding and
    kept it off."""
    model = Linear(10e-3, 0.1e-3)
    alloc = SmartSpecAllocator(model, draft_len=5, max_len=5)
    busy, idle = tracker_with(40), tracker_with(2)
    for _ in range(20):
        for _ in range(steps):
            alloc.assign(rounds(2, 0.006), idle)
        for _ in range(steps):
            alloc.assign(rounds(40, 0.030), busy)
    assert alloc.wait.predict(5, 1) == pytest.approx(0.006)
    assert alloc.draft_share(tracker_with(0)) == 1.0 and alloc.draft_share(busy) == 1.0
    assert alloc.wait.predict(5) > 0.025
    assert best_length(alloc.alpha(), 1, 200, 5, model, alloc.wait)[0] > 0
    one_line = DraftWaitModel()
    for k, y in alloc.wait.points:
        one_line.observe(k, y)  # every wait at one load
    assert best_length(alloc.alpha(), 1, 200, 5, model, one_line)[0] == 0
