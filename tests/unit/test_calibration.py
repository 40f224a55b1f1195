"""Draft confidence -> acceptance: only judged drafts teach the calibration (shared.calibration)."""

from __future__ import annotations

import pytest

from shared.calibration import ALPHA, BINS, PRIOR_WEIGHT, AcceptanceCalibration


def test_each_bin_starts_at_the_raw_confidence() -> None:
    cal = AcceptanceCalibration()
    for c in (0.05, 0.35, 0.95):
        assert cal.accept(c) == pytest.approx(c)


@pytest.mark.parametrize(("confidences", "accepted", "up", "down", "untouched"), [
    ([0.31, 0.32, 0.33], 3, [3], [], [9]),  # all accepted: bin 3 rises
    ([0.95, 0.55, 0.15], 0, [], [9], [5, 1]),  # the first rejected: the rest were never judged
    ([0.95, 0.55, 0.15], 1, [9], [5], [1]),  # one accepted, the second rejected, the third unjudged
    ([0.95, 0.55], 2, [9, 5], [], [1]),  # a full accept teaches nothing about a draft not sent
])
def test_only_judged_drafts_move_their_bins(confidences: list[float], accepted: int, up: list[int],
                                            down: list[int], untouched: list[int]) -> None:
    cal = AcceptanceCalibration()
    before = list(cal.rate)
    cal.observe(confidences, accepted)
    assert all(cal.rate[b] > before[b] for b in up)
    assert all(cal.rate[b] < before[b] for b in down)
    assert all(cal.rate[b] == before[b] for b in untouched)


def test_an_underconfident_drafter_is_learned() -> None:
    cal = AcceptanceCalibration()
    for _ in range(200):
        cal.observe([0.25, 0.25, 0.25], accepted=3)
    assert cal.accept(0.25) > 0.99
    assert cal.accept(0.75) == pytest.approx(0.75)  # other bins keep their prior


@pytest.mark.parametrize("confidence", [-0.5, 0.0, 1.0, 1.5])
def test_out_of_range_confidences_use_the_edge_bins(confidence: float) -> None:
    cal = AcceptanceCalibration()
    assert cal.accept(confidence) in (cal.rate[0], cal.rate[BINS - 1])


def test_a_bin_is_the_mean_of_its_prior_and_outcomes_until_it_has_enough() -> None:
    """Warm-up: a bin's first outcomes count fully (a running mean with its prior), so a badly
    calibrated drafter is learned in a few rounds; later ones enter a moving average."""
    cal = AcceptanceCalibration()
    for n in range(1, 6):
        cal.observe([0.22], accepted=1)  # bin 2, whose prior is its midpoint 0.25
        assert cal.accept(0.22) == pytest.approx((0.25 * PRIOR_WEIGHT + n) / (PRIOR_WEIGHT + n))
    assert cal.accept(0.22) > 0.85
    for _ in range(100):
        cal.observe([0.22], accepted=1)
    before = cal.accept(0.22)
    cal.observe([0.22], accepted=0)  # settled: one outcome moves it by ALPHA of the way
    assert cal.accept(0.22) == pytest.approx((1 - ALPHA) * before)
