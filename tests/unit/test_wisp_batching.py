"""WISP's SLO-aware batch scheduling (wisp.txt §4.2–4.3, Alg. 1) beside the FCFS baseline: pure table tests.

Times are made exact in binary floating point: the stand-in model costs 1 s per new token plus
1 s per batch, "now" is 100 s, and a deadline is set directly as arrived_at + 1 at 1 token/s.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from services.verifier.batching import (
    POLICIES,
    BatchLimits,
    Candidate,
    DeadlineBatcher,
    FcfsBatcher,
    SloClock,
    make_batcher,
    slo_met,
)
from services.verifier.batching.deadline import _coefficients, round_deadline

NOW = 100.0
ROOMY = BatchLimits(max_sessions=100, max_tokens=10_000)


@dataclass(frozen=True)
class Shape:
    new: int
    cached: int

    @property
    def total(self) -> int:
        return self.cached + self.new


@dataclass(frozen=True)
class LinearTime:
    """Test double for the step-time estimator: T = a·ΣL_new + b·Σ(L_total·L_new) + c·ΣL_cached + d."""

    a: float = 1.0
    b: float = 0.0
    c: float = 0.0
    d: float = 1.0
    floor: float = -math.inf  # a real estimator may clamp tiny batches

    def predict_sums(self, new: float, total_new: float, cached: float) -> float:
        return max(self.a * new + self.b * total_new + self.c * cached + self.d, self.floor)

    def predict(self, shapes: Sequence[Shape]) -> float:
        return self.predict_sums(sum(s.new for s in shapes), sum(s.total * s.new for s in shapes),
                                 sum(s.cached for s in shapes))


def due(sid: str, deadline: float, new: int = 1, *, cached: int = 0, expected: float = 1.0,
        ready: float = 0.0) -> Candidate:
    """A candidate whose round deadline d_i is ``deadline``: 1 token/s, nothing generated yet."""
    return Candidate(sid, new, cached, ready, cached=cached, expected_tokens=expected,
                     clock=SloClock(arrived_at=deadline - expected, slo_tokens_per_s=1.0))


def be(sid: str, new: int = 1, gain: float = 1.0, ready: float = 0.0, kv: int = 0) -> Candidate:
    """A best-effort candidate (no SLO) worth ``gain`` expected tokens."""
    return Candidate(sid, new, 0, ready, expected_tokens=gain, kv_tokens=kv)


def wisp(delta: float = 0.0, default_slo: float | None = None, kv: int | None = None,
         clock: Callable[[], float] = lambda: NOW, model: LinearTime | None = None) -> DeadlineBatcher:
    return DeadlineBatcher(model or LinearTime(), default_slo, delta_s=delta, clock=clock, kv_budget_tokens=kv)


# --- ordering and growth (Alg. 1) ------------------------------------------------------------------

ORDER_CASES = [
    pytest.param(  # LSTs 88, 98, 99 with δ = 5: all critical, EDF, the late one first; then best effort
        [be("eager", gain=100.0), due("b", 106.0), due("late", 90.0), due("a", 105.0)], 5.0,
        ["late", "a", "b", "eager"], None, id="critical-first-edf"),
    pytest.param(  # best effort by U = N̂_v / v̂: 3/3, 1/2, 2/5, 1/10
        [be("x", new=4, gain=2.0), be("y", new=1, gain=1.0), be("z", new=2, gain=3.0), be("w", new=9, gain=1.0)], 0.0,
        ["z", "y", "x", "w"], None, id="utility-density"),
    pytest.param(  # LST 102.5 > now with δ = 0: not critical, so utility decides
        [be("eager", gain=10.0), due("relaxed", 104.5)], 0.0, ["eager", "relaxed"], None, id="slack-is-not-critical"),
    pytest.param(  # equal utility: earlier ready first
        [be("second", ready=2.0), be("first", ready=1.0)], 0.0, ["first", "second"], None, id="ties-by-ready-since"),
    pytest.param(  # "big" would end at 107 > 103.5: stop there, though "small" (ends 103) would fit
        [be("small", gain=1.9), be("big", new=5, gain=6.0), due("tight", 103.5, expected=5.0)], 0.0,
        ["tight"], "deadline", id="stop-at-first-deadline-violation"),
    pytest.param(  # the added one's own deadline counts: with "eager" it would end at 105 > 104.5
        [be("eager", new=3, gain=100.0), due("own", 104.5)], 0.0, ["eager"], "deadline", id="own-deadline"),
    pytest.param(  # a critical violation skips the best-effort fill: with c2, c1 would end at 104 > 103.5
        [be("fill"), due("c1", 104.0), due("c2", 103.5, new=2)], 5.0, ["c2"], "deadline", id="critical-stop-no-fill"),
    pytest.param(  # late ones cannot meet their deadlines anyway: they bind nothing, all are served
        [due("late2", 60.0), due("late1", 50.0, new=30), be("after", new=40)], 0.0,
        ["late1", "late2", "after"], None, id="late-still-served"),
    pytest.param(  # best effort has no deadline to miss, however long the batch
        [be("p", new=50), be("q", new=50), be("r", new=50)], 0.0, ["p", "q", "r"], None,
        id="best-effort-never-violated"),
]


@pytest.mark.parametrize(("ready", "delta", "expected", "stop"), ORDER_CASES)
def test_order_and_growth(ready: list[Candidate], delta: float, expected: list[str], stop: str | None) -> None:
    batcher = wisp(delta)
    assert batcher.select(ready, ROOMY) == expected
    assert batcher.last_stop == stop


LIMIT_CASES = [
    pytest.param([be("a", gain=3.0), be("b", gain=2.0), be("c")], BatchLimits(2, 100), None,
                 ["a", "b"], "sessions", id="sessions"),
    pytest.param([be("a", new=3, gain=30.0), be("b", new=5, gain=30.0), be("c")], BatchLimits(9, 6), None,
                 ["a"], "tokens", id="tokens-stop-not-skip"),
    pytest.param([be("a", kv=6, gain=2.0), be("b", kv=6), be("c", kv=0, gain=0.5)], ROOMY, 10,
                 ["a"], "kv", id="kv-budget"),
    pytest.param([be("a", kv=6, gain=2.0), be("b", kv=4)], ROOMY, 10, ["a", "b"], None, id="kv-budget-exactly-full"),
    pytest.param([be("huge", new=50, gain=100.0), be("b")], BatchLimits(9, 8), None,
                 ["huge"], "tokens", id="first-taken-over-token-budget"),
    pytest.param([be("fat", kv=50), be("b", kv=1, gain=0.1)], ROOMY, 10, ["fat"], "kv", id="first-taken-over-kv"),
    pytest.param([be("a"), be("b")], BatchLimits(0, 100), None, ["a"], "sessions", id="first-taken-zero-sessions"),
    pytest.param([due("late", 10.0, new=500)], BatchLimits(4, 8), None, ["late"], None, id="first-taken-late-oversize"),
]


RIDER_CASES = [
    pytest.param([due("tight", 104.0)], LinearTime(), [0, 0, 0, 0], 2, id="until-the-deadline"),  # 102 + 1 a rider
    pytest.param([due("tight", 104.0)], LinearTime(c=0.5), [2, 2, 0], 1, id="cached-rows-count"),  # 102 + 2 a rider
    pytest.param([due("tight", 102.0)], LinearTime(), [0], 0, id="none-at-the-deadline"),
    pytest.param([be("free")], LinearTime(), [0] * 50, 50, id="best-effort-binds-nothing"),
    pytest.param([due("late", 90.0)], LinearTime(), [0] * 5, 5, id="a-late-member-binds-nothing"),
    pytest.param([], LinearTime(), [0, 0], 2, id="no-batch-yet"),
]


@pytest.mark.parametrize(("ready", "model", "cached", "fit"), RIDER_CASES)
def test_riders_fit_within_the_batchs_tightest_deadline(ready: list[Candidate], model: LinearTime, cached: list[int],
                                                        fit: int) -> None:
    """Riders (one token each in the step, ``Scheduler._add_riders``) go through FeasibleAdd too."""
    batcher = wisp(model=model)
    batcher.select(ready, ROOMY)
    assert batcher.riders_fit(cached) == fit
    assert FcfsBatcher().riders_fit(cached) == len(cached)


@pytest.mark.parametrize(("ready", "limits", "kv", "expected", "stop"), LIMIT_CASES)
def test_limits(ready: list[Candidate], limits: BatchLimits, kv: int | None, expected: list[str],
                stop: str | None) -> None:
    batcher = wisp(kv=kv)
    assert batcher.select(ready, limits) == expected
    assert batcher.last_stop == stop


def test_empty_ready_gives_an_empty_batch() -> None:
    assert wisp().select([], ROOMY) == []


@pytest.mark.parametrize(("default_slo", "expected", "critical"), [
    (None, ["eager", "old"], 0),  # no SLO anywhere: utility order
    (1.0, ["old", "eager"], 1),  # "old" arrived at 95 with nothing generated: deadline 96 has passed
])
def test_default_slo_applies_to_candidates_without_one(default_slo: float | None, expected: list[str],
                                                       critical: int) -> None:
    ready = [Candidate("old", 1, 0, 0.0, clock=SloClock(arrived_at=95.0)),
             Candidate("eager", 1, 0, 0.0, expected_tokens=9.0, clock=SloClock(slo_tokens_per_s=0.001, arrived_at=NOW))]
    batcher = wisp(default_slo=default_slo)
    assert batcher.select(ready, ROOMY) == expected
    assert batcher.last_critical == critical


def test_the_clock_gives_the_dispatch_time() -> None:
    now = [NOW]
    batcher = wisp(delta=5.0, clock=lambda: now[0])
    ready = [be("eager", gain=10.0), due("slo", 110.0)]  # v̂ = 2 s, so LST = 110 − 2 − 5 = 103
    assert batcher.select(ready, ROOMY) == ["eager", "slo"]
    assert batcher.last_critical == 0
    now[0] = 104.0
    assert batcher.select(ready, ROOMY) == ["slo", "eager"]  # both end at 107, within 110
    assert batcher.last_critical == 1


@pytest.mark.parametrize(("long_cached", "expected"), [(0, ["long", "short"]), (20, ["long"])])
def test_cached_rows_and_attention_enter_the_time_model(long_cached: int, expected: list[str]) -> None:
    """T̂ = 0.5·Σ(L_total·L_new) + 0.25·ΣL_cached: "short" alone takes 0.5·5 + 0.25·4 = 3.5 s (due 105);
    with "long" cached 20 deep the pair takes 0.5·26 + 0.25·24 = 19 s, uncached 0.5·6 + 0.25·4 = 4 s."""
    model = LinearTime(a=0.0, b=0.5, c=0.25, d=0.0)
    ready = [due("short", 105.0, cached=4), Candidate("long", 1, long_cached, 0.0, cached=long_cached,
                                                      expected_tokens=100.0)]
    assert wisp(model=model).select(ready, ROOMY) == expected


@pytest.mark.parametrize("model", [
    LinearTime(3.3e-5, 3.45e-8, 4.6e-6, 0.0149),  # the paper's Table 12 fit
    LinearTime(50e-6, 5e-9, 20e-9, -1e-3, floor=1e-5),  # a negative intercept, clamped near zero
])
def test_ranking_reads_the_affine_coefficients_off_the_model(model: LinearTime) -> None:
    assert _coefficients(model) == pytest.approx((model.a, model.b, model.c, model.d), rel=1e-6, abs=1e-12)


# --- the SLO and the deadline (eq. 6, 12) ----------------------------------------------------------

@pytest.mark.parametrize(("arrived", "generated", "slo", "now", "met"), [
    (0.0, 10, 5.0, 2.0, True),  # exactly 5 tokens/s
    (0.0, 10, 5.0, 2.5, False),  # 4 tokens/s
    (10.0, 0, 5.0, 10.0, True),  # no time has passed
    (0.0, 0, None, 99.0, True),  # best effort
    (0.0, 0, 0.0, 99.0, True),  # no target
    (0.0, 3, 2.0, 1.0, True),  # ahead of the target
])
def test_slo_met(arrived: float, generated: int, slo: float | None, now: float, met: bool) -> None:
    assert slo_met(arrived, generated, slo, now) is met


@pytest.mark.parametrize(("cand", "default", "deadline"), [
    (Candidate("s", 1, 0, 0.0, expected_tokens=2.0, clock=SloClock(10.0, 6, 4.0)), None, 12.0),
    (Candidate("s", 1, 0, 0.0, expected_tokens=2.0, clock=SloClock(10.0, 6)), 2.0, 14.0),  # the default
    (Candidate("s", 1, 0, 0.0, clock=SloClock(10.0, 6, 8.0)), 2.0, 10.875),  # its own wins
    (Candidate("s", 1, 0, 0.0, clock=SloClock(10.0, 6)), None, math.inf),  # best effort
])
def test_round_deadline(cand: Candidate, default: float | None, deadline: float) -> None:
    """d_i = A_i + (G_i + N̂_v,i)/s_c: the last moment this round can commit and keep the speed."""
    d = round_deadline(cand, default)
    assert d == deadline
    if math.isfinite(d):
        slo = cand.clock.slo_tokens_per_s or default
        assert slo_met(cand.clock.arrived_at, cand.clock.generated + cand.expected_tokens, slo, d)
        assert not slo_met(cand.clock.arrived_at, cand.clock.generated + cand.expected_tokens, slo, d + 1e-6)


def test_network_time_comes_off_every_deadline() -> None:
    """T_net (eq. 6's T_network) makes a request critical that much earlier and lets no batch run
    into the part of its deadline the user's side needs: "a" (d = 105) can share a 3 s step with
    "b" when the deadline is all the server's, not when 2.5 s of it belong to the network."""
    cand = Candidate("s", 1, 0, 0.0, expected_tokens=2.0, clock=SloClock(10.0, 6, 4.0))
    assert round_deadline(cand, None, 0.5) == 11.5 and round_deadline(be("x"), None, 0.5) == math.inf
    ready = [due("a", 105.0), be("b", new=1)]
    plain = wisp(delta=1.0)
    assert plain.select(ready, ROOMY) == ["a", "b"] and plain.last_critical == 0  # 103 <= 105; LST 102 > 100
    net = DeadlineBatcher(LinearTime(), delta_s=1.0, clock=lambda: NOW, network_s=2.5)
    assert net.select(ready, ROOMY) == ["a"] and net.last_stop == "deadline"  # 103 > 102.5
    assert net.last_critical == 1  # LST = 102.5 − 2 − 1 = 99.5 <= 100


# --- against a plain transcription of Alg. 1 on 1,000 candidates -----------------------------------

def alg1(ready: Sequence[Candidate], limits: BatchLimits, model: LinearTime, default: float | None, delta: float,
         kv_budget: int | None, now: float, network: float = 0.0) -> list[str]:
    """Alg. 1 written out directly, model calls on shapes and all (the interpretations as in wisp.py)."""
    v = {c.session_id: model.predict([Shape(c.new_tokens, c.cached)]) for c in ready}
    d = {c.session_id: round_deadline(c, default, network) for c in ready}
    crit = [c for c in ready if now >= d[c.session_id] - v[c.session_id] - delta]
    non = [c for c in ready if c not in crit]
    crit.sort(key=lambda c: (d[c.session_id], c.ready_since))
    non.sort(key=lambda c: (-c.expected_tokens / v[c.session_id], c.ready_since))

    def feasible(batch: list[Candidate]) -> bool:
        live = [d[c.session_id] for c in batch if now + v[c.session_id] <= d[c.session_id]]
        if len(batch) > limits.max_sessions or sum(c.new_tokens for c in batch) > limits.max_tokens:
            return False
        if kv_budget is not None and sum(c.kv_tokens for c in batch) > kv_budget:
            return False
        return now + model.predict([Shape(c.new_tokens, c.cached) for c in batch]) <= min(live, default=math.inf)

    chosen: list[Candidate] = []
    for cand in crit + non:
        if chosen and not feasible([*chosen, cand]):
            break
        chosen.append(cand)
    return [c.session_id for c in chosen]


def random_candidate(rng: random.Random, sid: str) -> Candidate:
    """Streams 0.5–60 s old that have run at 1–10 tokens/s against targets of 2–8 tokens/s or none."""
    age = rng.uniform(0.5, 60.0)
    clock = SloClock(arrived_at=NOW - age, generated=round(age * rng.uniform(1.0, 10.0)),
                     slo_tokens_per_s=rng.choice([2.0, 4.0, 6.0, 8.0, None]))
    return Candidate(sid, rng.randint(1, 9), 0, NOW - rng.random(), cached=rng.randint(0, 4000), clock=clock,
                     expected_tokens=rng.uniform(1.0, 5.0), kv_tokens=rng.choice([0, 0, 16, 64]))


@pytest.mark.parametrize(("seed", "limits", "kv_budget", "default", "network"), [
    pytest.param(0, BatchLimits(32, 2048), None, None, 0.0, id="sessions-stop"),
    pytest.param(1, BatchLimits(32, 2048), 512, 4.0, 0.0, id="kv-stop"),
    pytest.param(2, BatchLimits(1000, 100_000), None, None, 0.0, id="deadline-stop-in-fill"),
    pytest.param(3, BatchLimits(64, 120), 1024, 2.0, 0.0, id="tokens-stop"),
    pytest.param(4, BatchLimits(1000, 100_000), None, 4.0, 0.0, id="deadline-stop-critical"),
    pytest.param(5, BatchLimits(1000, 100_000), None, 4.0, 0.25, id="deadline-stop-with-network"),
])
def test_1000_candidates_match_alg1_and_are_valid(seed: int, limits: BatchLimits, kv_budget: int | None,
                                                  default: float | None, network: float) -> None:
    rng = random.Random(seed)
    ready = [random_candidate(rng, f"s{i}") for i in range(1000)]
    model = LinearTime(a=3.3e-5, b=3.45e-8, c=4.6e-6, d=0.0149)  # the paper's Table 12 fit
    batcher = DeadlineBatcher(model, default, delta_s=0.02, clock=lambda: NOW, kv_budget_tokens=kv_budget,
                          network_s=network)
    chosen = batcher.select(ready, limits)
    assert chosen == alg1(ready, limits, model, default, 0.02, kv_budget, NOW, network)
    by_id = {c.session_id: c for c in ready}
    batch = [by_id[s] for s in chosen]
    assert chosen and len(set(chosen)) == len(chosen) <= limits.max_sessions
    assert sum(c.new_tokens for c in batch) <= limits.max_tokens
    assert kv_budget is None or sum(c.kv_tokens for c in batch) <= kv_budget
    end = NOW + model.predict([Shape(c.new_tokens, c.cached) for c in batch])
    for c in batch:
        alone = NOW + model.predict([Shape(c.new_tokens, c.cached)])
        assert end <= round_deadline(c, default, network) or alone > round_deadline(c, default, network)


# --- FCFS and the factory ------------------------------------------------------------------------

@pytest.mark.parametrize(("ready", "limits", "expected"), [
    ([be("b", ready=2.0), be("a", ready=1.0), be("c", ready=3.0)], ROOMY, ["a", "b", "c"]),
    ([be("a", ready=1.0), be("b", ready=2.0), be("c", ready=3.0)], BatchLimits(2, 100), ["a", "b"]),
    ([be("a", new=5, ready=1.0), be("b", new=5, ready=2.0), be("c", new=2, ready=3.0)], BatchLimits(9, 8), ["a", "c"]),
    ([be("huge", new=50, ready=1.0), be("b", new=5, ready=2.0)], BatchLimits(9, 8), ["huge"]),
    ([due("late", 10.0, ready=2.0), be("a", ready=1.0)], ROOMY, ["a", "late"]),  # SLOs are ignored
])
def test_fcfs_is_unchanged(ready: list[Candidate], limits: BatchLimits, expected: list[str]) -> None:
    assert FcfsBatcher().select(ready, limits) == expected


def test_make_batcher() -> None:
    assert POLICIES == ("fcfs", "wisp")
    assert isinstance(make_batcher("fcfs"), FcfsBatcher)
    assert isinstance(make_batcher("fcfs", LinearTime(), 4.0), FcfsBatcher)
    batcher = make_batcher("wisp", LinearTime(), 4.0, delta_s=0.05, kv_budget_tokens=100, network_s=0.06)
    assert isinstance(batcher, DeadlineBatcher) and batcher.name == "wisp"
    assert (batcher.default_slo_tokens_per_s, batcher.delta_s, batcher.kv_budget_tokens) == (4.0, 0.05, 100)
    assert batcher.network_s == 0.06


@pytest.mark.parametrize(("call", "match"), [
    (lambda: make_batcher("wisp"), "needs a verification-time model"),
    (lambda: make_batcher("edf"), "unknown batching policy 'edf'; choose one of fcfs, wisp"),
    (lambda: DeadlineBatcher(LinearTime(), 0.0), "default_slo_tokens_per_s"),
    (lambda: DeadlineBatcher(LinearTime(), delta_s=-1.0), "delta_s"),
    (lambda: DeadlineBatcher(LinearTime(), kv_budget_tokens=-1), "kv_budget_tokens"),
    (lambda: DeadlineBatcher(LinearTime(), network_s=-0.1), "network_s"),
])
def test_bad_configuration_is_refused(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
