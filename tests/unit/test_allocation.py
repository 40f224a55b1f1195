"""Draft-length allocation: GoodSpeed's greedy optimum against brute force, the tracker's
EWMAs (eq. 3, 4), the baselines' budgets and SmartSpec's goodput choice."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

import pytest

from services.verifier.allocation import (
    AllocationSettings,
    GoodputTracker,
    RoundStats,
    make_allocator,
)
from services.verifier.allocation.base import expected_tokens
from services.verifier.allocation.draft_wait import DraftWaitModel
from services.verifier.allocation.goodspeed import greedy_lengths, length_at, solve
from services.verifier.allocation.smartspec import (
    ALPHA_TESTS,
    PROBE_EVERY,
    PROBE_STEPS,
    SWITCH_MARGIN,
    best_length,
    goodputs,
)
from services.verifier.batching.estimator import RecentLine, SegmentShape, StepTimeEstimator


def rs(sid: str, drafted: int = 4, accepted: int = 2, prob: float | None = None, drafter: str | None = "d",
       context: int = 100, wait: float = 0.0) -> RoundStats:
    return RoundStats(sid, drafter, drafted, accepted, context, float(accepted) if prob is None else prob, wait)


# --- GoodSpeed's objective ------------------------------------------------------------------


@pytest.mark.parametrize(("alpha", "length", "want"), [
    (0.0, 5, 1.0), (0.5, 0, 1.0), (0.5, 1, 1.5), (0.5, 2, 1.75), (0.9, 3, 1 + 0.9 + 0.81 + 0.729), (1.0, 4, 5.0),
])
def test_expected_tokens(alpha: float, length: int, want: float) -> None:
    assert expected_tokens(alpha, length) == pytest.approx(want)


def brute_force(alphas: Sequence[float], weights: Sequence[float], capacity: int, max_len: int) -> float:
    best = 0.0
    for lengths in itertools.product(range(max_len + 1), repeat=len(alphas)):
        if sum(lengths) <= capacity:
            best = max(best, sum(w * expected_tokens(a, s) for a, w, s in zip(alphas, weights, lengths, strict=True)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_greedy_marginal_gain_is_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    alphas = [rng.choice([0.0, rng.random(), 0.95]) for _ in range(n)]
    weights = [rng.uniform(0.05, 2.0) for _ in range(n)]
    capacity, max_len = rng.randint(0, 12), rng.randint(0, 6)
    lengths = greedy_lengths(alphas, weights, capacity, max_len)
    assert sum(lengths) <= capacity and all(0 <= s <= max_len for s in lengths)
    got = sum(w * expected_tokens(a, s) for a, w, s in zip(alphas, weights, lengths, strict=True))
    assert got == pytest.approx(brute_force(alphas, weights, capacity, max_len))


@pytest.mark.parametrize("seed", range(20))
def test_each_sessions_length_is_what_the_solves_marginal_value_gives_it(seed: int) -> None:
    """The threshold ``solve`` reports prices a draft token: at it, each session's own count of
    tokens worth at least that is its solved length (ties aside), so a new session can be given
    its share in O(1) (GoodSpeedAllocator.initial)."""
    rng = random.Random(seed)
    n = rng.randint(2, 40)
    alphas = [rng.uniform(0.05, 0.95) for _ in range(n)]
    weights = [rng.uniform(0.1, 2.0) for _ in range(n)]
    lengths, threshold = solve(alphas, weights, rng.randint(1, 4 * n), 12)
    for a, w, k in zip(alphas, weights, lengths, strict=True):
        assert length_at(a, w, threshold, 12) == k  # random gains: no ties


def test_goodspeed_prices_a_new_session_from_the_last_solve() -> None:
    t = GoodputTracker(eta=1.0, beta=1.0)
    alloc = make_allocator("goodspeed", AllocationSettings(draft_len=4, capacity=6, max_len=16))
    assert alloc.initial("x", t) == 4  # no solve yet: draft_len, within C
    for sid, a in (("a", 0.9), ("b", 0.3)):
        t.open(sid, sid)
        t.observe(rs(sid, 4, int(4 * a), 4 * a, drafter=sid))
    share = alloc.targets(t)["a"]  # one joint solve, over a and b
    t.open("c", "c")
    t.sessions["c"].alpha, t.sessions["c"].goodput = 0.9, t.sessions["a"].goodput  # a twin of a
    assert alloc.initial("c", t) == min(share, 6 - t.budget_total) > 0


def test_greedy_favours_the_session_with_low_goodput() -> None:
    # same acceptance, X = 1 vs X = 4: the starved session gets more of C (proportional fairness)
    lengths = greedy_lengths([0.7, 0.7], [1 / 1.0, 1 / 4.0], 6, 16)
    assert lengths[0] > lengths[1] and sum(lengths) == 6


# --- the tracker (eq. 3, 4) -----------------------------------------------------------------


@pytest.mark.parametrize(("budget", "drafted", "prob", "accepted", "alpha", "goodput"), [
    (0, 4, 4.0, 4, 0.9 * 0.5 + 0.1 * 1.0, 0.5 * 1.0 + 0.5 * 5),
    (4, 4, 1.0, 0, 0.9 * 0.5 + 0.1 * 0.25, 0.5 * 1.0 + 0.5 * 1),
    (0, 0, 0.0, 0, 0.5, 0.5 * 1.0 + 0.5 * 1),  # a budget-0 round: α̂ unchanged, X still moves
    (4, 0, 0.0, 0, 0.9 * 0.5, 0.5 * 1.0 + 0.5 * 1),  # 4 allotted, none drafted: counted as not accepted
    (4, 2, 2.0, 2, 0.9 * 0.5 + 0.1 * 0.5, 0.5 * 1.0 + 0.5 * 3),  # 2 of 4 drafted, both accepted: 1/S_i = 1/4
])
def test_tracker_ewmas(budget: int, drafted: int, prob: float, accepted: int, alpha: float, goodput: float) -> None:
    t = GoodputTracker(eta=0.1, beta=0.5, alpha0=0.5, goodput0=1.0)
    t.open("s", "d")
    t.set_budget("s", budget)
    est = t.observe(rs("s", drafted, accepted, prob))
    assert est.alpha == pytest.approx(alpha) and est.goodput == pytest.approx(goodput)


def test_tracker_counts_the_tokens_committed_through_each_drafter() -> None:
    t = GoodputTracker()
    t.observe(rs("a", 4, 3, drafter="small"))
    t.observe(rs("b", 4, 0, drafter="small"))
    t.observe(rs("c", 2, 2, drafter="ngram"))
    t.observe(rs("d", 0, 0, drafter=None))  # target-only: nobody's
    assert t.committed_by_drafter == {"small": (3 + 1) + (0 + 1), "ngram": 2 + 1}
    t.forget("a")
    assert t.committed_by_drafter["small"] == 5  # cumulative: finished sessions still count


def test_tracker_utility_inheritance_and_detach() -> None:
    t = GoodputTracker(eta=0.5, beta=0.5)
    for _ in range(10):
        t.observe(rs("a", 4, 4, drafter="small"))
    assert t.sum_log_x() == pytest.approx(math.log(t.sessions["a"].goodput))
    learned = t.sessions["a"].alpha
    t.forget("a")
    assert t.open("b", "small").alpha == pytest.approx(learned)  # the drafter's next session starts warm
    assert t.open("c", "other").alpha == pytest.approx(t.alpha0)
    t.set_budget("b", 5)
    t.detach("b")
    assert t.sessions["b"].budget == 0 and t.speculative() == 1


@pytest.mark.parametrize(("eta", "beta"), [(0.0, 0.5), (0.5, 1.5)])
def test_tracker_refuses_bad_smoothing(eta: float, beta: float) -> None:
    with pytest.raises(ValueError, match="must be in"):
        GoodputTracker(eta, beta)


# --- the policies under a global budget C ---------------------------------------------------


def tracker_with(budgets: dict[str, int]) -> GoodputTracker:
    t = GoodputTracker()
    for sid, b in budgets.items():
        t.open(sid, "d")
        t.set_budget(sid, b)
    return t


@pytest.mark.parametrize(("capacity", "sessions", "want"), [(0, 3, 4), (12, 3, 4), (12, 5, 2), (40, 2, 4)])
def test_fixed_s_gives_c_over_n_capped_at_draft_len(capacity: int, sessions: int, want: int) -> None:
    t = tracker_with({f"s{i}": 0 for i in range(sessions)})
    alloc = make_allocator("fixed", AllocationSettings(draft_len=4, capacity=capacity))
    assert set(alloc.assign([rs("s0")], t).values()) == {want}


@pytest.mark.parametrize("policy", ["random", "goodspeed"])
@pytest.mark.parametrize("seed", range(10))
def test_budgets_never_exceed_the_free_capacity(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    held = {f"o{i}": rng.randint(0, 5) for i in range(rng.randint(0, 4))}
    mine = [f"m{i}" for i in range(rng.randint(1, 4))]
    t = tracker_with({**held, **dict.fromkeys(mine, 3)})
    capacity = rng.randint(0, 30)
    alloc = make_allocator(policy, AllocationSettings(draft_len=4, capacity=capacity, max_len=6, seed=seed))
    rounds = [rs(sid) for sid in mine]
    for r in rounds:
        t.observe(r)
    budgets = alloc.assign(rounds, t)
    assert set(budgets) == set(mine)
    assert all(0 <= b <= 6 for b in budgets.values())
    assert sum(budgets.values()) <= max(0, capacity - sum(held.values()))


def test_goodspeed_spends_the_whole_budget_where_it_pays() -> None:
    t = GoodputTracker(eta=1.0, beta=1.0)
    good, bad = rs("good", 4, 4, 4.0), rs("bad", 4, 0, 0.4)
    for r in (good, bad):
        t.observe(r)
    budgets = make_allocator("goodspeed", AllocationSettings(draft_len=4, capacity=8, max_len=8)).assign(
        [good, bad], t)
    assert sum(budgets.values()) == 8 and budgets["good"] > budgets["bad"]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="choose one of fixed, random, goodspeed, smartspec"):
        make_allocator("nope", AllocationSettings())
    with pytest.raises(ValueError, match="estimator"):
        make_allocator("smartspec", AllocationSettings())


# --- SmartSpec ------------------------------------------------------------------------------


class Linear:
    """A step-time model: ``fixed`` seconds per step plus ``per_token`` per fed token."""

    def __init__(self, fixed: float, per_token: float) -> None:
        self.fixed, self.per_token = fixed, per_token

    def predict(self, shapes: Sequence[SegmentShape]) -> float:
        return self.fixed + self.per_token * sum(s.new for s in shapes)


@pytest.mark.parametrize(("sessions", "fixed", "per_token", "alpha", "want_zero"), [
    (1, 8e-3, 0.1e-3, 0.7, False),  # an idle verifier: a step costs the same with drafts, so speculate
    (64, 1e-3, 0.5e-3, 0.7, True),  # saturated: every token costs, drafts return less than they cost
    (1, 8e-3, 0.1e-3, 0.0, True),  # nothing is ever accepted: never speculate
])
def test_smartspec_switches_speculation_off_only_when_it_does_not_pay(
        sessions: int, fixed: float, per_token: float, alpha: float, want_zero: bool) -> None:
    k, goodput = best_length(alpha, sessions, 200, 8, Linear(fixed, per_token), DraftWaitModel())
    assert (k == 0) is want_zero
    assert goodput == pytest.approx(max(
        sessions * expected_tokens(alpha, j) / Linear(fixed, per_token).predict(
            [SegmentShape(1 + j, 200)] * sessions) for j in range(9)))


def slow_edge() -> DraftWaitModel:
    wait = DraftWaitModel()
    for k in range(1, 9):
        wait.observe(k, 0.020 + 0.010 * k)  # a slow edge: 20 ms + 10 ms per drafted token
    return wait


def test_smartspec_counts_the_wait_for_drafts() -> None:
    wait = slow_edge()
    assert wait.e0 == pytest.approx(0.020) and wait.e1 == pytest.approx(0.010)
    k_slow, _ = best_length(0.6, 1, 100, 8, Linear(5e-3, 0.1e-3), wait)
    k_fast, _ = best_length(0.6, 1, 100, 8, Linear(5e-3, 0.1e-3), DraftWaitModel())
    assert k_slow == 0 < k_fast


def test_the_draft_wait_is_the_mean_over_rounds_hits_included() -> None:
    """Half the rounds of length 4 found their (conditional) draft there already: the mean wait
    is half the misses' 4 ms; a round without a draft says nothing about the wait."""
    wait = DraftWaitModel(refit_every=1)
    for _ in range(8):
        wait.observe(4, 0.004)
        wait.observe(4, 0.0)
        wait.observe(0, 0.5)
    assert wait.predict(4) == pytest.approx(0.002) and wait.predict(0) == 0.0


def test_smartspec_counts_only_the_wait_other_sessions_do_not_fill() -> None:
    """An edge that takes 5 ms + 1 ms per drafted token: one session alone would leave the
    verifier idle through that wait, and speculation does not pay; with 40 sessions the verifier
    verifies the others' drafts meanwhile, the wait costs it nothing, and speculation pays."""
    wait = DraftWaitModel()
    for k in range(1, 9):
        wait.observe(k, 0.005 + 0.001 * k)
    k_alone, _ = best_length(0.6, 1, 100, 8, Linear(5e-3, 0.1e-3), wait)
    k_busy, _ = best_length(0.6, 40, 100, 8, Linear(5e-3, 0.1e-3), wait)
    assert k_alone == 0 < k_busy


def test_smartspec_prices_the_verifiers_work_outside_the_forward() -> None:
    """64 sessions on a forward of 1 ms + 0.5 ms per fed token: priced by the forward alone,
    drafts cost more than they return (k = 0, as in the table above). With 0.5 ms + 0.4 ms per
    session of the verifier's work between forwards, which a round pays once per session whatever
    k is, a round of 1 + α + ... tokens costs less per token than plain decoding's one."""
    model, overhead = Linear(1e-3, 0.5e-3), RecentLine(refit_every=1)
    for n in (1, 32, 64):
        overhead.observe(n, 0.5e-3 + 0.4e-3 * n)
    k_forward, _ = best_length(0.7, 64, 200, 8, model, DraftWaitModel())
    k, goodput = best_length(0.7, 64, 200, 8, model, DraftWaitModel(), overhead=overhead)
    assert k_forward == 0 < k
    assert goodput == pytest.approx(max(64 * expected_tokens(0.7, j) / (
        model.predict([SegmentShape(1 + j, 200)] * 64) + 0.5e-3 + 0.4e-3 * 64) for j in range(9)))
    assert goodputs(0.7, 64, 200, 8, model, DraftWaitModel(), RecentLine()) == goodputs(
        0.7, 64, 200, 8, model, DraftWaitModel())  # nothing measured yet: the forward alone


def test_smartspec_changes_its_length_only_for_a_clear_gain() -> None:
    model, wait = Linear(8e-3, 0.1e-3), DraftWaitModel()
    best, g_best = best_length(0.7, 1, 100, 8, model, wait)
    g = goodputs(0.7, 1, 100, 8, model, wait)
    near = next(k for k in range(9) if k != best and g[k] * 1.05 >= g_best)  # within 5 % of the best
    assert best_length(0.7, 1, 100, 8, model, wait, current=near, margin=0.05) == (near, pytest.approx(g[near]))
    assert best_length(0.7, 1, 100, 8, model, wait, current=0, margin=0.05)[0] == best  # 0 is far worse


def test_the_draft_wait_line_goes_through_each_lengths_mean() -> None:
    wait = DraftWaitModel(refit_every=1)
    for t in (0.002, 0.004):
        wait.observe(2, t)
    for t in (0.005, 0.005):
        wait.observe(4, t)
    assert wait.e1 == pytest.approx(0.001) and wait.e0 == pytest.approx(0.001)
    assert wait.predict(0) == 0.0 and wait.predict(3) == pytest.approx(0.004)


def test_smartspec_leaves_first_rounds_out_of_the_draft_wait() -> None:
    """A session's first draft also pays the drafter's prefill, and the first after a pause its
    catch-up on the tokens decoded without it: neither is a draft's usual wait."""
    alloc = make_allocator("smartspec", AllocationSettings(draft_len=4, max_len=8), Linear(8e-3, 0.1e-3))
    t = GoodputTracker()
    alloc.initial("a", t)
    alloc.assign([rs("a", 4, 4, wait=0.5)], t)  # first round
    assert not alloc.wait.points  # type: ignore[attr-defined]
    alloc.assign([rs("a", 4, 4, wait=0.004)], t)
    alloc.assign([rs("a", 0, 0)], t)  # a round at budget 0: nothing drafted
    alloc.assign([rs("a", 4, 4, wait=0.3)], t)  # the first drafted round after it: catch-up
    alloc.assign([rs("a", 4, 4, wait=0.005)], t)
    alloc.initial("a", t)  # resumed by another drafter
    alloc.assign([rs("a", 4, 4, wait=0.4)], t)
    assert list(alloc.wait.points) == [(4, 0.004), (4, 0.005)]  # type: ignore[attr-defined]


def test_smartspec_with_draft_len_0_still_measures_and_can_speculate() -> None:
    alloc = make_allocator("smartspec", AllocationSettings(draft_len=0, max_len=8), Linear(8e-3, 0.1e-3))
    t = GoodputTracker()
    assert alloc.initial("a", t) == 0
    k = alloc.assign([rs("a", 0, 0)], t)["a"]
    assert k == 1  # the warm-up drafts one token to learn α
    for _ in range(20):
        k = alloc.assign([rs("a", k, k)], t)["a"]
    assert k > 0


@pytest.mark.parametrize(("rounds", "want"), [
    ([(4, 4), (4, 4)], 1.0),  # every draft accepted: no test failed
    ([(4, 0)], 0.0),  # the first draft rejected: one test, failed
    ([(4, 2), (4, 4)], 6 / 7),  # 2 accepted + 1 rejected, then 4 accepted
    ([(4, 3), (2, 2), (0, 0)], 5 / 6),  # a round without drafts tests nothing
])
def test_smartspec_alpha_counts_drafts_up_to_the_first_rejection(rounds: list[tuple[int, int]], want: float) -> None:
    alloc = make_allocator("smartspec", AllocationSettings(draft_len=4, max_len=8), Linear(8e-3, 0.1e-3))
    t = GoodputTracker()
    alloc.assign([rs(f"s{i}", d, a) for i, (d, a) in enumerate(rounds)], t)
    assert alloc.alpha() == pytest.approx(want)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("old", "new", "drafts", "want"), [
    (10, 10, 8, (10 * 8 + 10 * 4) / (10 * 8 + 10 * 5)),  # 130 tests: every step counts
    (100, 205, 8, 4 / 5),  # the new steps hold 1025 >= ALPHA_TESTS tests: the old ones drop out
    (100, 100, 8, (66 * 8 + 100 * 4) / (66 * 8 + 100 * 5)),  # 500 new tests: the newest 66 old steps top them up
    (100, 128, 14, 7 / 8),  # new steps of 8 tests each hold exactly ALPHA_TESTS: the old ones drop out
    (100, 127, 14, (127 * 7 + 14) / (127 * 8 + 14)),  # 8 tests short: the newest old step tops them up
    (3, 1, 2 * ALPHA_TESTS, ALPHA_TESTS / (ALPHA_TESTS + 1)),  # one step over the limit: that step alone
])
def test_smartspec_alpha_spans_the_newest_alpha_tests_tested_drafts(old: int, new: int, drafts: int,
                                                                   want: float) -> None:
    """α over the newest whole steps that hold ALPHA_TESTS tested drafts, whatever the batch: at
    low load a window of 16 steps held too few drafts to steady it. ``old`` steps accept every
    draft (``drafts`` tests each), then ``new`` ones half (half + 1 tests: the first rejection)."""
    alloc = make_allocator("smartspec", AllocationSettings(draft_len=4, max_len=8), StepTimeEstimator())
    t = GoodputTracker()
    for i in range(old + new):
        alloc.assign([rs("a", drafts, drafts if i < old else drafts // 2)], t)
    assert alloc.alpha() == pytest.approx(want)  # type: ignore[attr-defined]


def test_smartspec_gives_every_session_of_a_batch_the_same_length() -> None:
    est = StepTimeEstimator(coef=(0.1e-3, 0.0, 0.0, 8e-3))
    alloc = make_allocator("smartspec", AllocationSettings(draft_len=1, max_len=8), est)
    t = GoodputTracker()
    rounds = [rs("a", 4, 4), rs("b", 4, 4)]
    for r in rounds:
        t.observe(r)
    for _ in range(16):  # past the warm-up, which drafts draft_len = 1
        budgets = alloc.assign(rounds, t)
    assert len(set(budgets.values())) == 1 and budgets["a"] > 1  # every draft accepted: long drafts pay
    assert alloc.initial("c", t) == budgets["a"]


def test_smartspec_keeps_its_length_within_the_switching_margin() -> None:
    """α falls from 1 to 0.875: the best length moves from 8 to 6, which predicts less than
    SWITCH_MARGIN more goodput than 8, so the allocator keeps 8 (it passes its last choice)."""
    est = StepTimeEstimator(coef=(0.5e-3, 0.0, 0.0, 2e-3))
    alloc = make_allocator("smartspec", AllocationSettings(draft_len=4, max_len=8), est)
    t = GoodputTracker()
    for _ in range(16):
        k = alloc.assign([rs("a", 9, 9)], t)["a"]  # α = 1 in the warm-up: the longest length
    assert k == 8
    for _ in range(ALPHA_TESTS // 8 + 1):  # α over the newest ALPHA_TESTS tests: these alone
        k = alloc.assign([rs("a", 8, 7)], t)["a"]  # α = 0.875: the best length drops a little
    g = goodputs(alloc.alpha(), 1, 100, 8, est, alloc.wait)  # type: ignore[attr-defined]
    assert max(range(9), key=g.__getitem__) == 6 and g[8] * (1 + SWITCH_MARGIN) >= g[6] > g[8]
    assert k == 8


def test_smartspec_keeps_probing_while_speculation_is_off() -> None:
    """Nothing is accepted, so it switches speculation off, after ``window`` steps of evidence;
    then PROBE_STEPS of every PROBE_EVERY batches draft again and keep the estimate fresh."""
    alloc = make_allocator("smartspec", AllocationSettings(draft_len=4, max_len=8), Linear(8e-3, 0.1e-3))
    t = GoodputTracker()
    ks: list[int] = []
    for _ in range(16 + 2 * PROBE_EVERY):
        k = ks[-1] if ks else 4
        ks.append(alloc.assign([rs("a", k, 0)], t)["a"])
    assert ks[:15] == [4] * 15  # too little evidence to switch off yet
    off = ks[16:]
    assert 0 in off and off.count(4) == 2 * PROBE_STEPS


def test_goodspeed_converges_to_the_joint_optimum_when_rounds_return_one_at_a_time() -> None:
    """Rounds come back asynchronously; no session starves while others hold the budget."""
    t = GoodputTracker(eta=1.0, beta=1.0)
    alloc = make_allocator("goodspeed", AllocationSettings(draft_len=8, capacity=12, max_len=16))
    alphas = {"a": 0.9, "b": 0.6, "c": 0.3}
    for sid in alphas:
        t.open(sid, sid)
        t.set_budget(sid, alloc.initial(sid, t))
    for _ in range(10):
        for sid, a in alphas.items():  # each round alone, with its acceptance as the observed rate
            k = t.sessions[sid].budget  # it drafts its whole budget
            r = rs(sid, k, int(k * a), k * a, drafter=sid)
            t.observe(r)
            t.set_budget(sid, alloc.assign([r], t)[sid])
    budgets = {sid: t.sessions[sid].budget for sid in alphas}
    assert sum(budgets.values()) <= 12 and all(b > 0 for b in budgets.values())
    assert budgets == alloc.targets(t)  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", range(5))
def test_tracker_keeps_its_totals_as_sessions_come_change_and_go(seed: int) -> None:
    """Σ S_i and the speculating count are kept incrementally; they always equal a recount."""
    rng = random.Random(seed)
    t = GoodputTracker()
    for _ in range(2000):
        sid, op = f"s{rng.randrange(30)}", rng.randrange(6)
        if op == 0:
            t.open(sid, rng.choice([None, "", "a", "b"]))
        elif op == 1:
            t.set_budget(sid, rng.randrange(8))
        elif op == 2:
            t.detach(sid)
        elif op == 3:
            t.forget(sid)
        else:
            t.observe(rs(sid, drafter=rng.choice([None, "a", "b"])))
        assert t.budget_total == sum(e.budget for e in t.sessions.values())
        assert t.speculative() == sum(1 for e in t.sessions.values() if e.drafter)
