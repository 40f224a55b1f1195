"""WISP's step-time estimator fitted on the real target's timed forwards (`make profile-verifier`'s sweep)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.verifier.batching.estimator import SegmentShape, StepTimeEstimator, evaluate, fit
from services.verifier.profile import make_runner, measure, plan_batches
from shared.models import load_model

pytestmark = pytest.mark.real


def test_profiler_sweep_on_the_real_target_fits(smollm2: Path) -> None:
    torch.set_num_threads(1)
    loaded = load_model(smollm2)
    # a small grid spanning ~20x in step time (so machine noise cannot hide the trend), plus mixed batches
    grid = [[SegmentShape(new=n, cached=c)] * b for b in (1, 16) for c in (32, 1000) for n in (1, 9)]
    batches = grid + plan_batches(16, 4, loaded.max_model_len, seed=0)
    samples = measure(make_runner(loaded, batches), batches, repeats=3, progress=False)
    assert all(t > 0 for _, t in samples)
    report = evaluate(StepTimeEstimator(fit(samples)), samples)
    assert report.r2 > 0.5, report
