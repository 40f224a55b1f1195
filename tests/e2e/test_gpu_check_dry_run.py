"""``make gpu-check DEVICE=cpu``: the GPU check's dry run, so that the script cannot rot before a GPU
host is at hand. Every step runs as on a GPU (a small model stands in for the Llama-3-8B shape)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def test_the_dry_run_passes_and_leaves_its_summary(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check"
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check", "DEVICE=cpu", f"OUT={out}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=400,
                          env={**os.environ, "BUDGET_S": "300"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = (out / "summary.md").read_text()
    for step in ("environment", "unit", "identity", "real shape"):
        assert f"| {step} | pass |" in summary, summary
    results = json.loads((out / "results.json").read_text())
    levels = {(lv["mode"], lv["sessions"]) for lv in results["levels"]}
    assert levels == {("target-only", 1), ("target-only", 4), ("oracle α=0.8", 1), ("oracle α=0.8", 4)}
    assert all(lv["tokens_per_s"] > 0 and lv["forward_ms"] > 0 for lv in results["levels"])
    oracle = [lv for lv in results["levels"] if lv["mode"].startswith("oracle")]
    assert all(0 < lv["acceptance"] <= 1 for lv in oracle)
    identity = next(s for s in results["steps"] if s["name"] == "identity")
    assert identity["detail"]["identical"] == identity["detail"]["requests"] == 8
    assert (out / "oracle-references.jsonl").read_text().count("\n") == 4
    assert summary in proc.stdout  # printed at the end
