"""The benchmark's load generator: arrivals, latency percentiles, prompt domains."""

from __future__ import annotations

import itertools

import pytest

from bench.client import Outcome, percentiles, poisson_arrivals
from bench.fleets import DOMAINS, domain_prompts


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate() -> None:
    a = poisson_arrivals(20.0, 4000, seed=3)
    assert a == poisson_arrivals(20.0, 4000, seed=3) and a != poisson_arrivals(20.0, 4000, seed=4)
    assert all(x < y for x, y in itertools.pairwise(a))
    assert 4000 / a[-1] == pytest.approx(20.0, rel=0.1)
    with pytest.raises(ValueError, match="> 0"):
        poisson_arrivals(0.0, 3)


@pytest.mark.parametrize(("values", "want"), [
    ([], {"p50": 0.0, "p90": 0.0, "p99": 0.0}),
    ([7.0], {"p50": 7.0, "p90": 7.0, "p99": 7.0}),
    ([float(i) for i in range(1, 101)], {"p50": 50.5, "p90": 90.1, "p99": 99.01}),
])
def test_percentiles(values: list[float], want: dict[str, float]) -> None:
    assert percentiles(values) == pytest.approx(want)


@pytest.mark.parametrize(("tokens", "first", "ttft", "tpot"), [
    (5, 1.2, 0.2, 0.2),  # sent at 1.0, first token at 1.2, done at 2.0: 4 more tokens in 0.8 s
    (1, 1.2, 0.2, 0.0),
    (0, 0.0, 1.0, 0.0),  # no token at all: TTFT is the whole request
])
def test_ttft_and_tpot(tokens: int, first: float, ttft: float, tpot: float) -> None:
    o = Outcome.of(tokens, 1.0, first, 2.0, {"drafted_tokens": 8, "accepted_tokens": 6})
    assert (o.ttft_s, o.tpot_s, o.latency_s, o.drafted, o.accepted) == pytest.approx((ttft, tpot, 1.0, 8, 6))


def test_domains_interleave_and_unknown_ones_are_refused() -> None:
    mixed = domain_prompts(["code", "prose"])
    assert mixed[:2] == [DOMAINS["code"][0], DOMAINS["prose"][0]]
    assert set(mixed) == set(DOMAINS["code"]) | set(DOMAINS["prose"])
    with pytest.raises(ValueError, match="unknown prompt domain"):
        domain_prompts(["poetry"])
