"""The simulator's validation simulates each real repeat with several seeds (``--seeds``): a short
row's simulated rate depends on its draws, so a row takes their median rate."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.sim import simulate
from bench.sim.validate import Knobs, compare, main, spec_of
from services.verifier.batching.estimator import StepTimeEstimator
from tests.unit.test_bench_scenarios import COEF, real_row

META = {"drafters": [["small", 0], ["ngram", 40]], "capacity": 8}


def row() -> dict[str, Any]:
    return {**real_row(), "goodput_tok_s": 100.0, "latency_s_mean": 1.0, "tokens_per_s_runs": [100.0]}


@pytest.mark.parametrize("seeds", [1, 3])
def test_a_row_is_the_median_rate_over_its_seeds(seeds: int) -> None:
    spec = spec_of("fairness", row(), META, COEF)
    assert spec is not None
    sims = [simulate(replace(spec, seed=seed)) for seed in range(seeds)]
    out = compare("fairness", row(), META, COEF, Knobs(seeds=seeds))
    assert out["sim_tok_s"] == pytest.approx(statistics.median(s.goodput_tok_s for s in sims))
    done = sum(s.requests_done for s in sims)
    assert out["sim_latency_s"] == pytest.approx(sum((s.latency_s or 0.0) * s.requests_done for s in sims) / done)


def test_the_seeds_differ() -> None:
    spec = spec_of("fairness", row(), META, COEF)
    assert spec is not None
    assert len({simulate(replace(spec, seed=seed)).goodput_tok_s for seed in range(3)}) > 1


def test_no_seeds_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--seeds", "0"])
    assert "--seeds must be at least 1" in capsys.readouterr().err


def test_a_validation_writes_under_its_stem(tmp_path: Path) -> None:
    """``--stem``: the real family's validation beside the demo family's, neither overwriting the other."""
    profile = tmp_path / "profile.json"
    StepTimeEstimator(COEF).save(profile)
    (tmp_path / "fairness.json").write_text(json.dumps({"meta": {**META, "when": "2026-12-02 19:24"},
                                                        "rows": [row()]}))
    assert main(["--results", str(tmp_path), "--sources", "fairness", "--estimator-file", str(profile),
                 "--seeds", "1", "--stem", "sim-validation-real", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "sim-validation-real.json").read_text())
    assert [r["scenario"] for r in data["rows"]] == [row()["scenario"]]
    assert (tmp_path / "sim-validation-real.md").exists() and not (tmp_path / "sim-validation.md").exists()
