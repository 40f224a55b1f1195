"""WISP's verification-time estimator (eq. 19): fit, predict, online refinement, files, the profiler."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from services.verifier.batching.estimator import (
    DEFAULT_COEF,
    MIN_SECONDS,
    FitReport,
    RecentLine,
    Sample,
    SegmentShape,
    StepTimeEstimator,
    TargetOnlyCost,
    evaluate,
    features,
    fit,
)

TRUE_COEFS = [
    (80e-6, 0.2e-6, 0.5e-6, 5e-3),  # like the demo target on this CPU
    (20e-6, 2e-9, 50e-9, 1e-3),  # attention and cache reads nearly free
    (5e-6, 1e-8, 0.0, 0.2e-3),  # no cache-read term at all
]


def eq19(coef: tuple[float, float, float, float], shapes: list[SegmentShape]) -> float:
    a, b, c, d = coef
    return sum(a * s.new + b * (s.cached + s.new) * s.new + c * s.cached for s in shapes) + d


def random_batch(rng: random.Random) -> list[SegmentShape]:
    batch = [SegmentShape(new=rng.randint(1, 9), cached=rng.randint(0, 1024)) for _ in range(rng.randint(1, 32))]
    if rng.random() < 0.25:
        batch.append(SegmentShape(new=rng.randint(32, 256), cached=rng.choice((0, 128))))
    return batch


def synthetic(coef: tuple[float, float, float, float], n: int, noise: float, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out: list[Sample] = []
    for _ in range(n):
        shapes = random_batch(rng)
        out.append((shapes, eq19(coef, shapes) * (1 + noise * rng.gauss(0, 1))))
    return out


def assert_close(
    got: tuple[float, ...], want: tuple[float, ...], samples: list[Sample], rel: float, floor: float = 0.01
) -> None:
    """Each term's contribution to a mean batch's time is within ``rel`` of the true one, or within
    ``floor`` of the mean batch time (a term too small to matter cannot be pinned down by noisy data)."""
    mean_x = np.array([[*features(s), 1.0] for s, _ in samples]).mean(axis=0)
    mean_t = float(np.mean([t for _, t in samples]))
    err = np.abs(np.asarray(got) - np.asarray(want)) * mean_x
    allowed = np.maximum(rel * np.asarray(want) * mean_x, floor * mean_t)
    assert (err <= allowed).all(), (got, want, err, allowed)


def test_segment_shape_and_features() -> None:
    shapes = [SegmentShape(new=5, cached=100), SegmentShape(new=200, cached=0)]
    assert shapes[0].total == 105
    assert features(shapes) == (205.0, 105 * 5 + 200 * 200, 100.0)
    assert features([]) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("coef", TRUE_COEFS)
@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_fit_recovers_known_coefficients(coef: tuple[float, float, float, float], noise: float) -> None:
    samples = synthetic(coef, 400, noise)
    got = fit(samples)
    assert all(v >= 0 for v in got)
    assert_close(got, coef, samples, rel=0.05)
    if noise == 0.0:
        assert got == pytest.approx(coef, rel=1e-6, abs=1e-15)


@pytest.mark.parametrize("coef", TRUE_COEFS)
def test_exact_data_fits_perfectly(coef: tuple[float, float, float, float]) -> None:
    samples = synthetic(coef, 100, 0.0, seed=1)
    report = evaluate(StepTimeEstimator(fit(samples)), samples)
    assert report.n == 100
    assert report.r2 == pytest.approx(1.0, abs=1e-9)
    assert report.mape == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("coef", [DEFAULT_COEF, *TRUE_COEFS])
def test_predict_equals_predict_sums(coef: tuple[float, float, float, float]) -> None:
    est = StepTimeEstimator(coef)
    rng = random.Random(2)
    for _ in range(50):
        shapes = random_batch(rng)
        assert est.predict(shapes) == est.predict_sums(*features(shapes))
        assert est.predict(shapes) == pytest.approx(eq19(coef, shapes), rel=1e-12)


@pytest.mark.parametrize("coef", TRUE_COEFS)
def test_observe_converges_towards_the_true_coefficients(coef: tuple[float, float, float, float]) -> None:
    est = StepTimeEstimator(window=256, refit_every=32)
    samples = synthetic(coef, 512, 0.01, seed=3)
    for shapes, seconds in samples[:31]:
        est.observe(shapes, seconds)
    assert est.coef == DEFAULT_COEF and not est.fitted  # no refit before refit_every observations
    for shapes, seconds in samples[31:]:
        est.observe(shapes, seconds)
    assert est.fitted
    before = evaluate(StepTimeEstimator(), samples)
    after = evaluate(est, samples)
    assert after.mape < 0.02 < before.mape
    assert after.r2 > 0.999
    assert_close(est.coef, coef, samples, rel=0.1, floor=0.02)  # a 1 %-noise window of 256


@pytest.mark.parametrize(
    "batch_of",
    [
        lambda i: [SegmentShape(new=5, cached=300)] * 4,  # every batch identical
        lambda i: [SegmentShape(new=6, cached=100 + 37 * i)],  # fixed k, warm: Σ(L_total·L_new) is collinear
        lambda i: [SegmentShape(new=1 + i % 9, cached=0)],  # never any cached row: c undetermined
    ],
    ids=["identical", "fixed-new", "no-cache"],
)
def test_degenerate_window_keeps_the_old_coefficients(batch_of: Callable[[int], list[SegmentShape]]) -> None:
    est = StepTimeEstimator(window=64, refit_every=8)
    rng = random.Random(4)
    for i in range(200):
        shapes = batch_of(i)
        est.observe(shapes, eq19(TRUE_COEFS[0], shapes) * (1 + 0.05 * rng.random()))
    assert est.coef == DEFAULT_COEF
    assert not est.fitted


def test_observe_ignores_bad_measurements() -> None:
    est = StepTimeEstimator(window=16, refit_every=1)
    for seconds in (0.0, -1.0, float("nan"), float("inf")):
        est.observe([SegmentShape(new=3, cached=10)], seconds)
    est.observe([], 0.01)
    assert est.coef == DEFAULT_COEF and not est.fitted


def test_degenerate_samples_do_not_fit() -> None:
    shapes = [SegmentShape(new=5, cached=300)]
    with pytest.raises(ValueError, match="do not determine"):
        fit([(shapes, 0.01)] * 20)
    with pytest.raises(ValueError):
        evaluate(StepTimeEstimator(), [])
    with pytest.raises(ValueError):
        StepTimeEstimator(window=2)


def test_save_load_round_trip(tmp_path: Path) -> None:
    est = StepTimeEstimator(fit(synthetic(TRUE_COEFS[0], 200, 0.01)))
    path = tmp_path / "sub" / "profile.json"
    est.save(path, report=FitReport(r2=0.98, mape=0.05, n=40), model="models/target", extra={"threads": 1})
    doc = json.loads(path.read_text())
    assert doc["features"] == ["sum_new", "sum_total_x_new", "sum_cached", "const"]
    assert {"coef", "r2", "mape", "n", "model", "created", "threads"} <= doc.keys()
    back = StepTimeEstimator.load(path)
    assert back.coef == est.coef
    assert back.fitted and not StepTimeEstimator().fitted
    assert back.report == FitReport(r2=0.98, mape=0.05, n=40)


@pytest.mark.parametrize("text", ["not json", "{}", '{"features": ["x"], "coef": [1, 2, 3, 4]}'])
def test_load_refuses_other_files(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="profile-verifier"):
        StepTimeEstimator.load(path)


@pytest.mark.parametrize("coef", [(0.0, 0.0, 0.0, 0.0), (-1e-3, 0.0, 0.0, 1e-3), (1e-6, -1e-6, -1e-6, -1.0)])
def test_predictions_are_always_positive(coef: tuple[float, float, float, float]) -> None:
    est = StepTimeEstimator(coef)
    rng = random.Random(5)
    assert est.predict([]) >= MIN_SECONDS > 0
    assert all(est.predict(random_batch(rng)) >= MIN_SECONDS for _ in range(50))
    assert est.predict_sums(-1e9, -1e9, -1e9) >= MIN_SECONDS


def test_fit_keeps_coefficients_non_negative() -> None:
    # times that fall as batches grow (nonsense, e.g. a warming machine): no cost goes negative
    samples = synthetic(TRUE_COEFS[0], 200, 0.0, seed=6)
    flipped: list[Sample] = [(s, 0.2 - t) for s, t in samples]
    coef = fit(flipped)
    assert all(v >= 0 for v in coef)
    assert all(StepTimeEstimator(coef).predict(s) > 0 for s, _ in flipped)


# --- the offline profiler ---------------------------------------------------------------------


@pytest.mark.parametrize(("points", "e0", "e1"), [
    ([(1, 0.0012), (32, 0.0074), (64, 0.0138)], 0.001, 0.0002),  # an exact line: recovered
    ([(16, 0.004), (16, 0.006)], 0.005, 0.0),  # one x only: flat through the mean
    ([(1, 0.009), (64, 0.003)], 0.006, 0.0),  # a cost does not fall with x: slope 0, the mean
    ([(10, 0.001), (20, 0.003)], 0.0, 0.0002),  # an intercept below 0 clamped to 0, the slope kept
])
def test_recent_line_fits_a_non_negative_cost(points: list[tuple[int, float]], e0: float, e1: float) -> None:
    line = RecentLine(refit_every=1)
    for x, y in points:
        line.observe(x, y)
    assert (line.e0, line.e1) == (pytest.approx(e0), pytest.approx(e1, abs=1e-12))
    assert line.predict(8) == pytest.approx(e0 + 8 * e1)


def test_recent_line_keeps_only_its_window_and_ignores_bad_points() -> None:
    line = RecentLine(window=4, refit_every=1)
    for x in range(1, 9):
        line.observe(x, 1.0 + x)  # slope 1 ...
    for x in range(1, 5):
        line.observe(x, 0.5 * x)  # ... then only the last four points, slope 0.5
    for bad in (-1.0, float("nan"), float("inf")):
        line.observe(3, bad)
    assert (line.e0, line.e1) == (pytest.approx(0.0, abs=1e-12), pytest.approx(0.5))
    with pytest.raises(ValueError, match="window"):
        RecentLine(window=1)


def test_profiler_plans_valid_shapes() -> None:
    from services.verifier.profile import plan_batches

    batches = plan_batches(max_batch=8, count=60, max_len=512, seed=0)
    assert len(batches) == 60
    assert all(1 <= len(b) <= 9 for b in batches)
    assert {len(b) for b in batches} >= {1, 8}  # batch sizes up to --max-batch
    assert all(s.new >= 1 and s.cached >= 0 and s.total <= 512 for b in batches for s in b)
    assert any(len({(s.new, s.cached) for s in b}) > 1 for b in batches)  # mixed batches too
    assert any(s.new > 16 for b in batches for s in b)  # and prefill chunks


def test_profiler_explains_a_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from services.verifier.profile import main

    assert main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "p.json")]) == 2
    assert "specfleet fetch-model" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


# --- the start-up calibration -------------------------------------------------------------------


def test_seed_fits_and_keeps_the_samples_for_online_refits() -> None:
    """Seeded from calibration forwards, then fed steps of one shape only (a fleet at one
    concurrency): the refits still determine all four coefficients, the seeds' variety in the window."""
    samples = synthetic(TRUE_COEFS[0], 24, 0.0)
    est = StepTimeEstimator(refit_every=8)
    est.seed(samples)
    assert est.fitted
    assert est.coef == pytest.approx(TRUE_COEFS[0], rel=1e-6)
    one_shape = [SegmentShape(new=5, cached=200)]
    for _ in range(8):
        est.observe(one_shape, eq19(TRUE_COEFS[0], one_shape))
    assert est.coef == pytest.approx(TRUE_COEFS[0], rel=1e-6)


def test_seed_refuses_samples_that_determine_nothing() -> None:
    est = StepTimeEstimator()
    with pytest.raises(ValueError, match="do not determine"):
        est.seed([([SegmentShape(new=1, cached=10)], 0.01)] * 30)
    assert est.coef == DEFAULT_COEF and not est.fitted


@pytest.mark.parametrize(("max_len", "free_rows", "want"), [
    (2048, 1 << 20, 16),  # the whole grid: 4 batch sizes x 2 contexts x 2 new-token counts
    (2048, 600, 12),  # a small KV arena: 4 or 8 sessions at 256 cached rows do not fit
    (64, 1 << 20, 16),  # a short context clamps the cached rows, and every shape still runs
])
def test_calibration_batches_fit_the_arena_and_the_context(max_len: int, free_rows: int, want: int) -> None:
    from services.verifier.profile import calibration_batches

    batches = calibration_batches(max_len, free_rows)
    assert len(batches) == want
    assert all(sum(s.total + 1 for s in b) <= free_rows and all(s.total <= max_len for s in b) for b in batches)


def test_calibrate_fits_the_served_runner(tiny_models: dict[str, Path]) -> None:
    """On the tiny target's batch-invariant runner, as the verifier serves it: a fitted estimator
    that prices a wider step above a narrower one, a target-only line for one session and for
    eight, and the arena left empty for serving. (The two lines are measured times of a tiny
    model, so which one is higher is noise: CI once saw 3.9 ms at eight under 7.2 ms at one.)"""
    from services.verifier.profile import calibrate
    from shared.models import load_model
    from shared.runner import ModelRunner
    from shared.runner.runner import kv_shape

    loaded = load_model(tiny_models["target"])
    runner = ModelRunner(loaded, 8192 * kv_shape(loaded.model).bytes_per_token, "auto", batch_invariant=True)
    est = StepTimeEstimator()
    assert calibrate(runner, est, loaded.max_model_len) > 0
    assert est.fitted and est.coef != DEFAULT_COEF
    assert est.predict([SegmentShape(new=5, cached=128)] * 8) > est.predict([SegmentShape(new=1, cached=128)])
    wide, narrow = est.target_only.predict(8, 128), est.target_only.predict(1, 128)
    assert wide is not None and narrow is not None and wide > 0 and narrow > 0
    assert runner.kv.allocate(runner.kv.tokens) is not None  # every slot given back


def test_target_only_cost_keeps_a_line_per_session_count_of_one_token_forwards() -> None:
    """Forwards feeding every session one token make a line in the context per session count; a
    round of drafts and a prefill chunk, priced absurdly, change nothing."""
    line = TargetOnlyCost()
    assert line.predict(1, 100) is None and line.table() == []
    for sessions, at_zero, per_row in ((1, 0.030, 2e-5), (4, 0.033, 4e-5), (8, 0.040, 8e-5)):
        for cached in (32, 256):
            line.observe([SegmentShape(new=1, cached=cached)] * sessions, at_zero + per_row * cached)
            line.observe([SegmentShape(new=5, cached=cached)] * sessions, 10.0)
            line.observe([SegmentShape(new=1, cached=cached), SegmentShape(new=64, cached=0)], 10.0)
    assert [b for b, _, _ in line.table()] == [1, 4, 8]
    assert line.predict(4, 100) == pytest.approx(0.033 + 4e-5 * 100)
    assert line.predict(6, 100) == pytest.approx((0.037 + 0.048) / 2)  # halfway between 4 and 8 sessions
