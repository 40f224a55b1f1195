"""AdaSpec's trim in the engine: calibrated confidences, probe steps, bounded state, the gap."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from services.verifier.batching import BatchLimits, FcfsBatcher
from services.verifier.batching.estimator import StepTimeEstimator
from services.verifier.scheduler import Scheduler
from services.verifier.trim import ConfidenceTrim, NoTrim, make_trim
from services.verifier.trim.confidence import GAP_ALPHA, MAX_CALIBRATIONS, MAX_GAP_S, PROBE_EVERY

EXPENSIVE = StepTimeEstimator(coef=(5e-3, 0.0, 0.0, 1e-3))  # a fed token costs 5x a step's fixed part


def scheduler() -> Scheduler:
    return Scheduler(FcfsBatcher(), BatchLimits(32, 2048), 256, EXPENSIVE, make_trim("adaspec"))


def request(rid: str, confidence: list[float] | None) -> Any:
    draft = SimpleNamespace(confidence=confidence)
    return SimpleNamespace(request_id=rid, round=SimpleNamespace(draft=draft), cached=10, committed=[1] * 11,
                           drafter="edge-1")


def test_probes_count_only_steps_that_could_be_trimmed() -> None:
    """Steps with no confidences in between must not use up the count: every PROBE_EVERY-th
    trimmable step verifies everything, whatever else runs."""
    s = scheduler()
    drafts = {"a": [5, 6, 7], "b": [5, 6, 7]}
    kept = []
    for _ in range(2 * PROBE_EVERY):
        assert s._trim([request("b", None)], drafts) == {}  # nothing to trim: not a probe either
        kept.append(s._trim([request("a", [0.3, 0.3, 0.3])], drafts).get("a", 3))
    probes = [i for i, k in enumerate(kept) if k == 3]
    assert probes == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1]
    assert all(k == 0 for i, k in enumerate(kept) if i not in probes)  # otherwise 0.3 is not worth it


def test_calibrations_are_kept_for_the_drafters_heard_from_last() -> None:
    s = ConfidenceTrim()
    for i in range(MAX_CALIBRATIONS + 5):
        s.observe_round(f"drafter-{i}", [0.9, 0.9], 2, 2)
    s.observe_round("drafter-5", [0.9], 1, 1)  # heard again: now the most recent
    assert len(s.calibrations) == MAX_CALIBRATIONS
    assert "drafter-0" not in s.calibrations and "drafter-5" in s.calibrations
    assert list(s.calibrations)[-1] == "drafter-5"


def test_no_trim_keeps_no_calibration() -> None:
    s = NoTrim()
    s.observe_round("edge-1", [0.9], 1, 1)
    s.observe_gap(0.01)
    assert s.status() == {}
    assert s.decide([], EXPENSIVE, []) == {}


def test_the_gap_between_steps_is_a_moving_average_that_skips_idleness() -> None:
    s = ConfidenceTrim()
    s.observe_gap(0.004)
    assert s.gap_s == pytest.approx(0.004)  # the first one as it is
    s.observe_gap(0.014)
    assert s.gap_s == pytest.approx(0.004 + GAP_ALPHA * 0.010)
    before = s.gap_s
    s.observe_gap(MAX_GAP_S + 1.0)  # the verifier idled between requests: not a step's period
    s.observe_gap(-0.001)
    assert s.gap_s == before


def test_the_trim_reads_the_gap() -> None:
    """With EXPENSIVE's costs drafts at 0.6 are not worth their rows; with a gap of 0.4 s
    between forwards, they are."""
    s = scheduler()
    drafts = {"a": [5, 6, 7]}
    assert s._trim([request("a", [0.6, 0.6, 0.6])], drafts) == {"a": 0}
    s.trim.observe_gap(0.4)
    assert s._trim([request("a", [0.6, 0.6, 0.6])], drafts) == {"a": 3}
