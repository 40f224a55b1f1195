"""WISP's drafting controller: labels, the rejection MLP, its report, learning, screening, training command."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from services.drafter.control import ControlSettings, make_controller
from services.drafter.control.base import Spread, StepDecision, StepFeatures, keep_until_stop
from services.drafter.control.predicted_rejection import PredictorState, RejectionStopController
from services.drafter.control.rejection_predictor import (
    FEATURES,
    RejectionMLP,
    _gradients,
    auc,
    best_threshold,
    evaluate,
    feature_row,
    round_labels,
    split,
    train,
)
from services.drafter.control.threshold import ThresholdController
from services.drafter.wisp_train import main as wisp_train


@pytest.mark.parametrize(("drafted", "accepted", "labels"), [
    (4, 4, [1, 1, 1, 1]),  # all accepted
    (4, 2, [1, 1, 0]),  # the first rejection is 0; what follows it was never judged
    (4, 0, [0]),
    (0, 0, []),
    (3, 7, [1, 1, 1]),  # accepted is clamped to what was drafted
])
def test_round_labels(drafted: int, accepted: int, labels: list[int]) -> None:
    assert round_labels(drafted, accepted) == labels


def _brute_auc(scores: list[float], labels: list[int]) -> float:
    pos = [s for s, y in zip(scores, labels, strict=True) if y == 1]
    neg = [s for s, y in zip(scores, labels, strict=True) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize(("scores", "labels"), [
    ([0.9, 0.8, 0.3, 0.1], [1, 1, 0, 0]),
    ([0.1, 0.8, 0.3, 0.9], [1, 1, 0, 0]),
    ([0.5, 0.5, 0.5, 0.5], [1, 0, 1, 0]),  # ties count half
    ([0.2, 0.7, 0.7, 0.4, 0.7, 0.1], [0, 1, 0, 1, 1, 0]),
])
def test_auc_is_the_pairwise_win_rate(scores: list[float], labels: list[int]) -> None:
    assert auc(np.array(scores), np.array(labels)) == pytest.approx(_brute_auc(scores, labels))


def test_evaluate_counts_the_table_4_columns() -> None:
    scores = np.array([0.9, 0.8, 0.2, 0.6, 0.1, 0.7])
    y = np.array([1, 1, 1, 0, 0, 0])
    r = evaluate(scores, y, 0.5)  # predicted accepted: 0.9, 0.8, 0.6, 0.7
    assert r.rec1 == pytest.approx(2 / 3) and r.spec == pytest.approx(1 / 3) and r.fpr == pytest.approx(2 / 3)
    assert r.accuracy == pytest.approx(3 / 6) and r.balanced_accuracy == pytest.approx(0.5)


def test_best_threshold_separates_separable_scores() -> None:
    scores = np.linspace(0, 1, 200)
    y = (scores > 0.3).astype(np.int64)
    t = best_threshold(scores, y)
    assert evaluate(scores, y, t).balanced_accuracy > 0.98


def test_backprop_matches_numerical_gradients() -> None:
    rng = np.random.default_rng(3)
    x, y, w = rng.normal(size=(7, 5)), rng.integers(0, 2, 7).astype(np.float64), rng.uniform(0.5, 2, 7)
    params = [rng.normal(size=s) for s in [(5, 4), (4,), (4, 4), (4,), (4, 1), (1,)]]

    def loss() -> float:
        model = RejectionMLP(np.zeros(5), np.ones(5), [(params[i], params[i + 1]) for i in (0, 2, 4)])
        p = np.clip(model.accept_prob(x), 1e-12, 1 - 1e-12)
        return float(np.mean(-w * (y * np.log(p) + (1 - y) * np.log(1 - p))))

    grads = _gradients(params, x, y, w)
    for p, g in zip(params, grads, strict=True):
        for idx in np.ndindex(p.shape):
            old = p[idx]
            p[idx] = old + 1e-6
            up = loss()
            p[idx] = old - 1e-6
            down = loss()
            p[idx] = old
            assert g[idx] == pytest.approx((up - down) / 2e-6, abs=1e-6)


def _synthetic(n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Acceptance that rises with confidence and falls with entropy, as WISP Fig. 2 shows."""
    rng = np.random.default_rng(seed)
    top1 = rng.uniform(0.05, 1.0, n)
    entropy = rng.uniform(0.0, 4.0, n) * (1.2 - top1)
    x = np.column_stack([top1, top1, entropy, top1 * rng.uniform(0.3, 1.0, n), rng.uniform(1, 4, n)])
    p_accept = 1 / (1 + np.exp(-(6 * top1 - 1.0 * entropy - 1.5)))
    return x, (rng.random(n) < p_accept).astype(np.int64)


def test_mlp_learns_the_rejection_signal_and_beats_always_accept() -> None:
    x, y = _synthetic(6000)
    x_train, y_train, x_test, y_test = split(x, y, 0.2)
    model = train(x_train, y_train)
    report = evaluate(model.accept_prob(x_test), y_test, model.threshold)
    always = evaluate(np.ones(len(y_test)), y_test, 0.5)
    assert report.auc > 0.8 and report.balanced_accuracy > 0.7
    assert always.fpr == 1.0 and report.fpr < 0.4  # it catches most rejections the baseline lets through


def test_training_needs_both_classes() -> None:
    with pytest.raises(ValueError, match="both"):
        train(np.ones((10, 5)), np.ones(10, dtype=np.int64))


def test_predictor_file_round_trip_and_refusal(tmp_path: Path) -> None:
    x, y = _synthetic(1000)
    model = train(x, y)
    path = tmp_path / "wisp.json"
    model.save(path)
    again = RejectionMLP.load(path)
    assert np.array_equal(again.accept_prob(x), model.accept_prob(x)) and again.threshold == model.threshold
    path.write_text(path.read_text().replace('"entropy"', '"perplexity"'))
    with pytest.raises(ValueError, match="retrain it"):
        RejectionMLP.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        RejectionMLP.load(tmp_path / "missing.json")


def _step(top1: float, position: int = 0) -> StepFeatures:
    return StepFeatures(position=position, budget=6, token_id=1, token_prob=top1, top1_prob=top1, top2_prob=0.0,
                        spread=Spread(entropy=(1 - top1) * 3, logit_std=2.0))


def _confidence_model() -> RejectionMLP:
    """P(accepted) = sigmoid(20 (top1 - 0.5)): rejection predicted below 0.5."""
    w1 = np.zeros((len(FEATURES), 1))
    w1[0, 0] = 20.0
    return RejectionMLP(np.zeros(len(FEATURES)), np.ones(len(FEATURES)),
                        [(w1, np.zeros(1)), (np.eye(1), np.zeros(1)), (np.eye(1), np.array([-10.0]))], 0.5)


def test_wisp_drafts_the_budget_until_it_has_a_predictor_then_stops_at_the_first_predicted_rejection() -> None:
    state = PredictorState(train_after=0)
    controller = make_controller("wisp", ControlSettings(wisp=state))
    assert isinstance(controller, RejectionStopController) and controller.wants_features
    assert controller.begin_round(6) == 6
    assert [controller.on_step(_step(c)) for c in (0.9, 0.1)] == [StepDecision.CONTINUE] * 2
    state.model = _confidence_model()
    controller.begin_round(6)
    decisions = [controller.on_step(_step(c, i)) for i, c in enumerate((0.9, 0.8, 0.3))]
    assert decisions == [StepDecision.CONTINUE, StepDecision.CONTINUE, StepDecision.STOP]


@pytest.mark.parametrize(("trained", "confidences", "budget", "kept"), [
    (False, (0.9, 0.1, 0.9), 6, 3), (True, (0.9, 0.8, 0.3, 0.9), 6, 3), (True, (0.9, 0.8, 0.3), 2, 2),
    (True, (0.1,), 6, 1)])
def test_wisp_keeps_what_its_round_would_and_records_nothing(trained: bool, confidences: tuple[float, ...],
                                                             budget: int, kept: int) -> None:
    state = PredictorState(train_after=0)
    state.model = _confidence_model() if trained else None
    controller = RejectionStopController(state)
    assert controller.keeps([_step(c, i) for i, c in enumerate(confidences)], budget) == kept
    assert controller._rows == [] and len(state._rows) == 0


def test_wisp_records_labelled_rounds_and_trains_in_the_background(tmp_path: Path) -> None:
    samples = tmp_path / "samples.csv"
    state = PredictorState(train_after=600, samples_path=samples)
    controller = RejectionStopController(state)
    x, y = _synthetic(1500)
    rows_done = 0
    while state.trainings == 0 and rows_done < len(y):
        # one round per accepted-run in the synthetic labels: accepted ones, then the rejection
        end = rows_done
        while end < len(y) - 1 and y[end] == 1 and end - rows_done < 5:
            end += 1
        controller.begin_round(6)
        for row in x[rows_done:end + 1]:
            controller.on_step(StepFeatures(0, 6, 1, row[1], row[0], row[0] - row[3], Spread(row[2], row[4])))
        drafted = end + 1 - rows_done
        controller.end_round(drafted, int(y[rows_done:end + 1].sum()) if y[end] == 0 else drafted)
        rows_done = end + 1
        state.wait_trained(30)
    state.close()
    assert state.trainings == 1 and state.model is not None
    lines = samples.read_text().splitlines()
    assert lines[0] == ",".join([*FEATURES, "accepted"]) and len(lines) - 1 == rows_done >= 600


def test_wisp_learns_nothing_from_a_round_it_did_not_watch() -> None:
    state = PredictorState(train_after=0)
    controller = RejectionStopController(state)
    controller.begin_round(4)
    controller.end_round(3, 1)  # a draft made without its features (no steps seen)
    assert len(state._rows) == 0


@pytest.mark.parametrize(("confidences", "kept"), [((0.9, 0.9, 0.9), 3), ((0.9, 0.3, 0.9), 2), ((0.1, 0.9), 1)])
def test_a_ready_lookahead_is_screened_by_the_sessions_controller(confidences: tuple[float, ...], kept: int) -> None:
    controller = ThresholdController(0.4)
    controller.begin_round(6)
    assert keep_until_stop(controller.on_step, [_step(c) for c in confidences], 6) == kept
    assert controller.keeps([_step(c) for c in confidences], 6) == kept


def test_feature_row_order_matches_the_header() -> None:
    step = StepFeatures(0, 4, 7, token_prob=0.2, top1_prob=0.6, top2_prob=0.1, spread=Spread(1.5, 3.0))
    assert dict(zip(FEATURES, feature_row(step), strict=True)) == pytest.approx(
        {"top1_prob": 0.6, "token_prob": 0.2, "entropy": 1.5, "margin": 0.5, "logit_std": 3.0})


def test_wisp_train_command_reports_and_writes_a_servable_predictor(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    x, y = _synthetic(3000)
    samples = tmp_path / "samples.csv"
    np.savetxt(samples, np.column_stack([x, y]), delimiter=",", header=",".join([*FEATURES, "accepted"]),
               comments="", fmt="%.6g")
    out, report = tmp_path / "wisp.json", tmp_path / "report.md"
    assert wisp_train([str(samples), "--out", str(out), "--report", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "| MLP (3-layer) | 600 |" in printed and "always accept (fixed k)" in printed
    assert RejectionMLP.load(out).accept_prob(x[:3]).shape == (3,) and "AUC" in report.read_text()


def test_wisp_train_command_explains_a_wrong_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert wisp_train([str(bad)]) == 2
    assert "--wisp-samples" in capsys.readouterr().err
