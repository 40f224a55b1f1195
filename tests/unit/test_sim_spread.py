"""Measured spreads in the simulator (``bench/sim/spread.py``): from the drafters' histograms to
factors of mean 1 on their batches and hand-offs."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from bench.run_stats import buckets
from bench.scrape import Snapshot
from bench.sim import CostSpec, DrafterSpec, SimSpec, VerifierSpec, simulate
from bench.sim.spread import Spread
from bench.sim.validate import Knobs, drafter_params, spec_of
from tests.unit.test_bench_scenarios import COEF, real_row

H = "specfleet_drafter_round_phase_seconds"


@pytest.mark.parametrize(("histogram", "above", "bins"), [
    ([[1.0, 0], [2.0, 3], [5.0, 1]], 0.0, ((1.0, 2.0, 3.0), (2.0, 5.0, 1.0))),
    ([[1.0, 2], [math.inf, 2]], 0.0, ((0.0, 1.0, 2.0), (1.0, 2.0, 2.0))),  # unbounded: as wide as below it
    ([[0.05, 9], [2.0, 1], [5.0, 1]], 0.05, ((0.05, 2.0, 1.0), (2.0, 5.0, 1.0))),  # drafted nothing: left out
    ([[1.0, 4], [2.0, 2]], 1.5, ((1.5, 2.0, 2.0),)),  # a bucket astride the floor is cut at it
])
def test_a_spread_takes_a_histograms_buckets_as_bins(histogram: list[list[float]], above: float,
                                                     bins: tuple[tuple[float, float, float], ...]) -> None:
    spread = Spread.of_buckets(histogram, above)
    assert spread is not None and spread.bins == bins


def test_a_spread_of_nothing_is_none_and_nonsense_is_refused() -> None:
    assert Spread.of_buckets([[0.05, 10]], above=0.05) is None and Spread.of_buckets([]) is None
    with pytest.raises(ValueError, match="bins"):
        Spread(((2.0, 1.0, 1.0),))
    with pytest.raises(ValueError, match="mean"):
        Spread(((0.0, 0.0, 1.0),))


def test_a_spreads_factors_have_mean_1_and_its_shape() -> None:
    spread = Spread(((1.0, 2.0, 3.0), (10.0, 20.0, 1.0)))  # mean (1.5·3 + 15) / 4 = 4.875
    rng = random.Random(0)
    draws = [spread.factor(rng) for _ in range(20_000)]
    assert statistics.fmean(draws) == pytest.approx(1.0, rel=0.03)
    assert min(draws) >= 1.0 / 4.875 and max(draws) <= 20.0 / 4.875
    assert sum(d < 2.0 / 4.875 for d in draws) / len(draws) == pytest.approx(0.75, abs=0.02)


def test_the_benchmarks_record_a_histograms_buckets_one_by_one() -> None:
    snap = Snapshot({(f"{H}_bucket", (("le", le), ("phase", "send"))): n
                     for le, n in (("0.001", 2.0), ("0.002", 5.0), ("+Inf", 6.0))})
    snap[(f"{H}_bucket", (("le", "0.001"), ("phase", "draft")))] = 7.0
    assert buckets(snap, H, phase="send") == [[1.0, 2.0], [2.0, 3.0], [math.inf, 1.0]]
    assert buckets(snap, H, unit=1.0, phase="send") == [[0.001, 2.0], [0.002, 3.0], [math.inf, 1.0]]  # a count


def fleet(spread: Spread | None, fill: bool = True) -> SimSpec:
    d = DrafterSpec("d0", alpha=0.7, token_s=1e-3, forward_s=5e-4, send_s=1e-3, rtt_s=0.01, concurrency=1,
                    requests=6, max_tokens=60, draft_spread=spread, send_spread=spread)
    return SimSpec(drafters=(d,), cost=CostSpec("h100"), rounds=None, duration_s=600.0,
                   verifier=VerifierSpec(fill=fill))


def test_spread_drafts_arrive_unevenly_and_the_fill_policy_sees_it() -> None:
    """Without a spread the fill policy learns waits with almost no deviation; with one (1 to 9
    times a cost's tenth, mean 1) the same session's drafts arrive unevenly, every token still
    committed once, and the result is the same for the same seed."""
    wide = Spread(((0.1, 0.2, 1.0), (0.5, 1.0, 1.0), (1.5, 2.5, 1.0)))
    even, uneven = simulate(fleet(None)), simulate(fleet(wide))
    assert even.committed == uneven.committed == 6 * 60
    [flat], [spread] = even.fill_wait_deviation_s, uneven.fill_wait_deviation_s
    assert flat is not None and spread is not None and spread > 3 * flat
    assert simulate(fleet(wide)).goodput_tok_s == uneven.goodput_tok_s


def test_the_validation_spreads_a_drafter_as_its_rounds_did_when_asked() -> None:
    phases = {"draft": [[0.05, 40], [2.0, 10], [5.0, 10]], "send": [[1.0, 3], [2.0, 1]]}
    own = {name: {"draft_ms_per_token": 1.0, "drafted_per_round": 4.0, "accepted_per_round": 2.0,
                  "phase_buckets_ms": phases} for name in ("drafter-1", "drafter-2")}
    row = real_row(by_drafter=own)
    d = drafter_params(row, 2)[0]
    assert d.draft_spread == Spread(((0.05, 2.0, 10.0), (2.0, 5.0, 10.0)))  # only rounds that drafted
    assert d.send_spread == Spread(((0.0, 1.0, 3.0), (1.0, 2.0, 1.0)))
    meta = {"drafters": [["small", 0], ["small", 0]], "capacity": 8}
    plain, spread = spec_of("fairness", row, meta, COEF), spec_of("fairness", row, meta, COEF, knobs=Knobs(spread=True))
    assert plain is not None and spread is not None
    assert all(x.draft_spread is None and x.send_spread is None for x in plain.drafters)
    assert all(x.draft_spread == d.draft_spread and x.send_spread == d.send_spread for x in spread.drafters)
