"""SmartSpec's draft waits: a level per load band under one slope in the draft's length, or, when the
drafter times its drafts, the wait in parts (network, drafting per token, lookaheads)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.verifier.allocation import GoodputTracker, RoundStats, SmartSpecAllocator
from services.verifier.allocation.draft_wait import (
    BAND_MIN,
    BAND_WINDOW,
    TIMED_HORIZON_S,
    DraftWaitModel,
    Timed,
    WaitSample,
    band,
    timed_fit,
)
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


# --- timed by the drafter (Draft.drafting_s, Draft.ahead): the wait in parts --------------------------


@pytest.mark.parametrize(("k", "alpha", "head_start", "ahead", "want_ms"), [
    (4, 0.9, 0.030, 0.0, 10 + 4 * 5),  # no lookahead: a fresh draft, net + drafting
    (4, 1.0, 0.030, 1.0, 0.0),  # always ahead, and its 5 tokens (25 ms) are in before the 30 ms round ends
    (8, 1.0, 0.030, 1.0, 45 - 30),  # always ahead, but 45 ms of drafting outlast the round by 15
    (4, 0.5, 0.030, 1.0, (1 - 0.5**4) * 30),  # ahead only when all 4 are accepted (1/16): else fresh
    (4, 1.0, 0.030, 0.5, 0.5 * 30),  # the drafter pipelines (and guesses the bonus) half the time
    (2, 0.9, 0.0, 1.0, (1 - 0.81) * 20 + 0.81 * 15),  # no head start: a lookahead saves the net only
])
def test_a_timed_wait_is_fresh_drafts_and_lookaheads_in_their_shares(k: int, alpha: float, head_start: float,
                                                                     ahead: float, want_ms: float) -> None:
    """net 10 ms, 5 ms per drafted token."""
    assert Timed(0.010, 0.005, ahead).wait(k, alpha, head_start) == pytest.approx(want_ms / 1e3)


@pytest.mark.parametrize(("rest", "want_ms"), [(0.0, 15.0), (0.010, 5.0), (0.015, 0.0), (0.030, 0.0)])
def test_a_rounds_unpriced_time_is_head_start_for_its_lookahead(rest: float, want_ms: float) -> None:
    """8 tokens ahead take 45 ms; the round's priced verification is 30 ms, and ``rest`` more."""
    assert Timed(0.010, 0.005, 1.0, rest).wait(8, 1.0, 0.030) == pytest.approx(want_ms / 1e3)


def timed_rounds(n: int, k: int, net: float, per_token: float, when: float = 0.0) -> list[WaitSample]:
    """n rounds of k tokens: every other one a lookahead after a fully accepted round (waited 0),
    the rest fresh drafts that waited their drafting plus ``net``."""
    return [WaitSample(when, k, 0.0, 0.0, True, True) if i % 2 else
            WaitSample(when, k, net + per_token * k, per_token * k, False, i % 4 == 0) for i in range(n)]


def test_the_timed_parts_are_the_drafters_own_timing_and_the_lookaheads_share() -> None:
    rounds = timed_rounds(4 * BAND_MIN, 8, 0.006, 0.007)
    t = timed_fit(rounds)
    assert t is not None
    assert t.per_token == pytest.approx(0.007) and t.net == pytest.approx(0.006)
    # after a fully accepted round: every lookahead (2 of each 4 rounds) and one fresh draft of each 4
    assert t.ahead == pytest.approx(2 / 3)
    assert timed_fit(timed_rounds(2 * BAND_MIN - 2, 8, 0.006, 0.007)) is None  # BAND_MIN - 1 fresh drafts
    untimed = [WaitSample(0.0, 8, 0.050) for _ in range(4 * BAND_MIN)]
    assert timed_fit(untimed) is None  # a drafter that does not time its drafts


def observe_all(wait: DraftWaitModel, rounds: Sequence[WaitSample], sessions: float = 1) -> None:
    for r in rounds:
        wait.observe(r.k, r.wait, sessions, r.drafting_s, r.ahead, r.after_full)


def test_timed_waits_price_a_shorter_draft_where_one_length_gave_no_slope() -> None:
    """Every round drafted 8 tokens, so the slope in k reads 0 and a 4-token draft looks as slow to
    come as an 8-token one; the drafter's timing prices it 28 ms quicker."""
    wait = DraftWaitModel(refit_every=1)
    observe_all(wait, [WaitSample(0.0, 8, 0.006 + 0.056, 0.056, False, False)] * BAND_MIN)
    assert wait.fit == (0.0, pytest.approx({1: 0.062}))
    assert wait.predict(4, 1) == pytest.approx(0.062)  # without α: the level
    assert wait.predict(4, 1, alpha=0.9, head_start=0.030) == pytest.approx(0.006 + 0.028)
    assert wait.predict(8, 1, alpha=0.9, head_start=0.030) == pytest.approx(0.062)
    assert wait.predict(0, 1, alpha=0.9) == 0.0


def test_the_timed_parts_outlive_the_waits_horizon_but_not_their_own() -> None:
    clock = Clock()
    wait = DraftWaitModel(refit_every=1, clock=clock)
    assert not wait.timing()
    observe_all(wait, [WaitSample(0.0, 8, 0.062, 0.056, False, False)] * (BAND_MIN - 1))
    assert wait.timing() and not wait.timed  # timed drafts, too few to price by: SmartSpec holds its length
    observe_all(wait, [WaitSample(0.0, 8, 0.062, 0.056, False, False)])
    assert not wait.timing() and set(wait.timed) == {1}
    clock.now = 5.0  # the waits are stale: nothing is assumed of them (SmartSpec tries speculation again)
    wait.expire()
    assert wait.stale() and wait.predict(4, 1, alpha=0.9) == 0.0
    observe_all(wait, [WaitSample(0.0, 4, 0.005, 0.0, True, True)])  # one lookahead: the old drafts still time it
    assert wait.timed[1].per_token == pytest.approx(0.007)
    assert wait.predict(4, 1, alpha=1.0, head_start=0.030) == pytest.approx(0.005)  # no band level yet: the line
    observe_all(wait, [WaitSample(0.0, 4, 0.005, 0.0, True, True)] * BAND_MIN)
    # priced in parts again: always ahead now (π = 1), 5 tokens of 7 ms against a 30 ms head start
    assert wait.predict(4, 1, alpha=1.0, head_start=0.030) == pytest.approx(0.005)
    assert wait.predict(4, 1, alpha=1.0, head_start=0.035) == pytest.approx(0.0)
    clock.now = 5.1 + TIMED_HORIZON_S
    wait.expire()
    assert not wait.timed and not wait._rounds


def edge_round(k: int, full: bool, ahead: bool, net: float, per_token: float, verify: float) -> RoundStats:
    """A session's round on an edge whose drafter drafts ``per_token`` a token, ``net`` apart:
    a lookahead (after a fully accepted round) waited only for what outlasts the verification."""
    wait = max(0.0, per_token * (k + 1) - verify) if ahead else net + per_token * k
    return RoundStats("s", "d", k, k if full else k // 2, 300, 0.0, wait, 0.0 if ahead else per_token * k, ahead)


def test_smartspec_leaves_the_longest_length_once_the_drafter_times_its_drafts() -> None:
    """A 30 ms verification, a drafter of 10 ms a token 6 ms away whose lookaheads always come true
    after a fully accepted round, and 3 of 4 rounds accepted whole. Untimed, every round at k = 8
    reads as no slope, and SmartSpec stays at 8 (the longest); timed, it finds that a lookahead of
    2 or 3 (30-40 ms) about fits in the verification, where one of 8 (90 ms) waits 60 ms beyond it."""
    model = Linear(0.030, 0.0)

    def run(timed: bool, timed_waits: bool = True) -> int:
        alloc = SmartSpecAllocator(model, draft_len=8, max_len=8, timed_waits=timed_waits)
        tracker, k, full = tracker_with(1), 8, False
        for step in range(400):
            r = edge_round(k, step % 4 != 0, full, 0.006, 0.010, 0.030)
            if not timed:
                r = RoundStats(r.session_id, r.drafter, r.drafted, r.accepted, r.context_len, 0.0, r.draft_wait_s)
            full = r.accepted == r.drafted
            k = alloc.assign([r], tracker)["s"]
        return k

    assert run(timed=False) == 8
    assert 2 <= run(timed=True) <= 5
    assert run(timed=True, timed_waits=False) == 8  # --smartspec-timed-waits false: the timings are not used


@pytest.mark.parametrize(("verify_s", "want_rest"), [(None, 0.070), (0.100, 0.020)])
def test_a_rounds_unpriced_time_leaves_out_what_the_core_measured_from_draft_to_verdict(
        verify_s: float | None, want_rest: float) -> None:
    """A session's rounds 0.15 s apart: 0.03 s waiting for its draft, then 0.10 s from its draft in
    to its verdict (behind the other sessions' forwards and in a forward shared with them), against
    0.05 s priced for its segment alone. Measured by the core, those 0.10 s are not ``rest``: the
    verifier's work for every session is priced once already (``verify_all``)."""
    clock = Clock()
    alloc = SmartSpecAllocator(Linear(0.050, 0.0), draft_len=4, max_len=8)
    alloc.wait = DraftWaitModel(refit_every=1, clock=clock)
    tracker = tracker_with(1)
    for _ in range(4 * BAND_MIN):
        clock.now += 0.15
        alloc.assign([RoundStats("s0", "d", 4, 4, 300, 0.0, 0.03, 0.02, False, verify_s)], tracker)
    assert alloc.wait.rest(1) == pytest.approx(want_rest)
