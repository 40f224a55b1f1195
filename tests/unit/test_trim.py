"""Verifier-side draft trimming: the none baseline and AdaSpec's draft token elimination."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from services.verifier.trim import (
    POLICIES,
    ConfidenceTrim,
    NoTrim,
    SegmentShape,
    TrimItem,
    acceptance_chain,
    expected_accepted,
    make_trim,
)


@dataclass
class Linear:
    """Stand-in step-time model: base + per fed row + per KV row read; records every call."""

    base: float = 0.01
    per_new: float = 0.001
    per_total: float = 0.0
    calls: list[list[SegmentShape]] = field(default_factory=list)

    def predict(self, shapes: Sequence[SegmentShape]) -> float:
        self.calls.append(list(shapes))
        return self.base + sum(self.per_new * s.new + self.per_total * s.total for s in shapes)


@dataclass
class Step:
    """A step in the cost: ``low`` while at most ``rows`` rows are fed in all, ``high`` above."""

    rows: int
    low: float = 1.0
    high: float = 2.0

    def predict(self, shapes: Sequence[SegmentShape]) -> float:
        return self.low if sum(s.new for s in shapes) <= self.rows else self.high


def _items(*confs: Sequence[float], cached: int = 100, fed: int = 1) -> list[TrimItem]:
    return [TrimItem(f"s{i}", cached, fed, tuple(c)) for i, c in enumerate(confs)]


def _efficiency(items: Sequence[TrimItem], kept: Sequence[int], model: Linear) -> float:
    tokens = sum(1 + expected_accepted(it.confidence[:k]) for it, k in zip(items, kept, strict=True))
    return tokens / model.predict([it.shape(k) for it, k in zip(items, kept, strict=True)])


@pytest.mark.parametrize(("confs", "chain"), [((), []), ((0.5,), [0.5]), ((0.8, 0.5, 0.0), [0.8, 0.4, 0.0]),
                                              ((1.5, -0.2, 0.9), [1.0, 0.0, 0.0]), ((math.nan, 1.0), [0.0, 0.0])])
def test_acceptance_chain_is_the_clamped_running_product(confs: tuple[float, ...], chain: list[float]) -> None:
    assert acceptance_chain(confs) == pytest.approx(chain)
    assert expected_accepted(confs) == pytest.approx(sum(chain))


@pytest.mark.parametrize("confs", [[(0.1, 0.1)], [(0.9,) * 8, (0.2,) * 3], [(), (0.5,)]])
def test_none_keeps_everything(confs: list[tuple[float, ...]]) -> None:
    items, policy = _items(*confs), make_trim("none", tpot_slo_s=1e-6)
    assert policy.keep(items, Linear(per_new=10.0)) == {it.session_id: it.drafts for it in items}
    assert policy.last is not None and policy.last.kept == policy.last.offered and policy.last.fits_slo is False


@pytest.mark.parametrize("n", [1, 4, 16])
def test_confident_drafts_kept_when_tokens_are_cheap(n: int) -> None:
    items = _items((0.95,) * n, (0.9,) * n)
    assert ConfidenceTrim().keep(items, Linear(base=0.02, per_new=1e-5)) == {"s0": n, "s1": n}


@pytest.mark.parametrize(("confs", "kept"), [((0.9, 0.1, 0.1), 1), ((0.1, 0.1), 0), ((0.99, 0.9, 0.05, 0.9), 2)])
def test_unlikely_tails_dropped_when_tokens_are_expensive(confs: tuple[float, ...], kept: int) -> None:
    # a draft row costs a fifth of the fixed cost: worth it only if accepted with p > ~0.2 * eff
    assert ConfidenceTrim().keep(_items(confs), Linear(base=0.01, per_new=0.002)) == {"s0": kept}


def test_elimination_order_is_by_cumulative_confidence_across_sessions() -> None:
    items = _items((0.9, 0.5), (0.8, 0.7, 0.6))  # chains: s0 0.9 0.45; s1 0.8 0.56 0.336
    model = Linear(base=0.0, per_new=1.0)  # every row costs as much as a whole step: drop them all
    assert ConfidenceTrim().keep(items, model) == {"s0": 0, "s1": 0}
    news = [tuple(s.new for s in call) for call in model.calls]
    assert news == [(3, 4), (3, 3), (2, 3), (2, 2), (2, 1), (1, 1)]  # s1 tail, s0, s1, s1, s0


def test_stops_at_the_first_elimination_that_does_not_help() -> None:
    # Dropping one draft saves nothing (still above the step), dropping two would halve the time:
    # Alg. 2 stops at the first non-improving candidate, so all four stay.
    items = _items((0.2,) * 4)
    policy = ConfidenceTrim()
    assert policy.keep(items, Step(rows=3)) == {"s0": 4}
    assert policy.last is not None and policy.last.predictions == 2


@pytest.mark.parametrize("seed", range(20))
def test_result_within_draft_counts_and_efficiency_not_worse(seed: int) -> None:
    rng = random.Random(seed)
    items = _items(*[[rng.random() ** 0.3 for _ in range(rng.randrange(0, 5))] for _ in range(rng.randrange(1, 4))],
                   cached=rng.randrange(0, 500), fed=rng.randrange(1, 3))
    model = Linear(base=rng.uniform(0.001, 0.02), per_new=rng.uniform(1e-5, 5e-3), per_total=rng.uniform(0, 1e-5))
    policy = ConfidenceTrim()
    kept = policy.keep(items, model)
    counts = [kept[it.session_id] for it in items]
    assert all(0 <= k <= it.drafts for it, k in zip(items, counts, strict=True))
    full = _efficiency(items, [it.drafts for it in items], model)
    assert policy.last is not None and policy.last.efficiency == pytest.approx(_efficiency(items, counts, model))
    assert policy.last.efficiency >= full * (1 - 1e-12)
    assert policy.last.predictions <= 1 + sum(it.drafts for it in items)
    best = max(_efficiency(items, ks, model) for ks in itertools.product(*[range(it.drafts + 1) for it in items]))
    assert policy.last.efficiency <= best * (1 + 1e-12)  # sanity of the brute force itself


@pytest.mark.parametrize(("gap", "kept"), [(0.0, 1), (0.01, 2), (0.1, 3)])
def test_a_gap_between_steps_makes_dropping_worth_less(gap: float, kept: int) -> None:
    """A draft row costs a fifth of the forward's fixed part; with a gap between forwards (the
    verifier's own work, its wait for drafts) the saved row is a smaller part of the period,
    so less likely tails are kept. The efficiency reported is tokens over forward plus gap."""
    items = _items((0.9, 0.3, 0.2))  # chain 0.9, 0.27, 0.054
    model = Linear(base=0.01, per_new=0.002)
    policy = ConfidenceTrim()
    assert policy.keep(items, model, gap_s=gap) == {"s0": kept}
    tokens = 1 + expected_accepted(items[0].confidence[:kept])
    assert policy.last is not None
    assert policy.last.efficiency == pytest.approx(tokens / (model.predict([items[0].shape(kept)]) + gap))


def test_the_tpot_guard_reads_the_forward_alone_not_the_gap() -> None:
    items = _items((0.99,) * 4)
    model = Linear(base=0.01, per_new=0.0005)  # 0.0125 with every draft
    policy = ConfidenceTrim(tpot_slo_s=0.013)
    assert policy.keep(items, model, gap_s=0.05) == {"s0": 4}
    assert policy.last is not None and policy.last.fits_slo is True


@pytest.mark.parametrize("slo", [0.02, 0.015, 0.012])
def test_tpot_guard_trims_until_the_step_fits(slo: float) -> None:
    items = _items((0.99,) * 8, (0.95,) * 8)
    model = Linear(base=0.01, per_new=0.0005)  # full batch: 0.01 + 18 * 0.0005 = 0.019
    unguarded = ConfidenceTrim().keep(items, model)
    assert unguarded == {"s0": 8, "s1": 8}
    policy = ConfidenceTrim(tpot_slo_s=slo)
    kept = policy.keep(items, model)
    predicted = model.predict([it.shape(kept[it.session_id]) for it in items])
    assert policy.last is not None and policy.last.fits_slo is True and predicted <= slo
    # the guard stops as soon as the step fits: one more draft would not
    assert predicted + 0.0005 > slo or kept == unguarded


def test_tpot_guard_drops_everything_when_nothing_fits() -> None:
    policy = ConfidenceTrim(tpot_slo_s=0.005)
    assert policy.keep(_items((0.99,) * 4, (0.9,) * 2), Linear(base=0.01)) == {"s0": 0, "s1": 0}
    assert policy.last is not None and policy.last.fits_slo is False and policy.last.kept == 0


@pytest.mark.parametrize("name", POLICIES)
def test_empty_batch(name: str) -> None:
    policy, model = make_trim(name), Linear()
    assert policy.keep([], model) == {}
    assert model.calls == [] and policy.last is not None and policy.last.offered == 0


def test_fixed_segments_count_in_the_step_time() -> None:
    items, fixed = _items((0.6, 0.6)), [SegmentShape(new=5, cached=50)]
    model = Linear(base=0.0, per_new=0.001)
    policy = ConfidenceTrim()
    policy.keep(items, model, fixed=fixed)
    assert all(call[-1] == fixed[0] for call in model.calls)
    assert policy.last is not None and policy.last.expected_tokens >= 2.0  # a token from each segment


def test_sessions_without_drafts_are_kept_at_zero() -> None:
    assert ConfidenceTrim().keep(_items((), (0.9,)), Linear(per_new=1e-6)) == {"s0": 0, "s1": 1}


def test_large_batch_costs_one_prediction_per_candidate() -> None:
    rng = random.Random(7)
    items = _items(*[[rng.random() for _ in range(16)] for _ in range(32)])
    policy = ConfidenceTrim(tpot_slo_s=0.05)
    kept = policy.keep(items, Linear(base=0.02, per_new=0.0002))
    assert policy.last is not None and policy.last.predictions <= 1 + 32 * 16
    assert sum(kept.values()) == policy.last.kept < policy.last.offered


@pytest.mark.parametrize(("kwargs", "message"), [({"cached": -1, "fed": 1}, "cached"),
                                                 ({"cached": 0, "fed": 0}, "fed")])
def test_item_validation(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrimItem("s", confidence=(), **kwargs)


@pytest.mark.parametrize("policy", [NoTrim(), ConfidenceTrim()])
def test_duplicate_sessions_rejected(policy: NoTrim | ConfidenceTrim) -> None:
    with pytest.raises(ValueError, match="twice"):
        policy.keep([*_items((0.5,)), *_items((0.5,))], Linear())


@pytest.mark.parametrize(("name", "slo", "message"), [("fifo", None, "unknown trim policy 'fifo'"),
                                                      ("adaspec", 0.0, "SLO"), ("none", -1.0, "SLO")])
def test_make_trim_rejects_bad_arguments(name: str, slo: float | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_trim(name, tpot_slo_s=slo)
