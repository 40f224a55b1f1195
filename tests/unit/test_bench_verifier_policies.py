"""``bench verifier-policies``: the SmartSpec part's baselines and the checks on their flag."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import bench.verifier_policies as vp


def test_smartspec_part_runs_one_fixed_k_fleet_per_length(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def serve(models: Any, scs: list[Any], loads: list[int], *rest: Any) -> dict[str, Any]:
        seen.update(scenarios=scs, loads=loads)
        return {}

    monkeypatch.setattr(vp, "serve_loads", serve)
    monkeypatch.setattr(vp, "smallest", lambda drafts: drafts[0])
    args = argparse.Namespace(smartspec_ks=[2, 4, 6], draft_len=3, loads=[1, 16], max_tokens=8, repeats=1,
                              estimator_file="", smartspec_forward_only=False)
    vp.smartspec_part(SimpleNamespace(drafts=[tmp_path]), args, SimpleNamespace(), tmp_path)
    scs = seen["scenarios"]
    assert [sc.name for sc in scs] == ["target-only", "fixed k=2", "fixed k=4", "fixed k=6", "smartspec"]
    assert [sc.draft_len for sc in scs[1:4]] == [2, 4, 6] and scs[0].drafters == 0
    assert scs[-1].draft_len == 3 and "smartspec" in scs[-1].verifier_flags
    assert "--smartspec-overhead" not in scs[-1].verifier_flags
    # SmartSpec as specfleet up runs it; the fixed k fleets send every request to their drafter
    assert scs[-1].speculation == "auto" and all(sc.speculation == "" for sc in scs[1:4])
    assert seen["loads"] == [1, 16]
    # the paper's forward-only model beside it, on request
    vp.smartspec_part(SimpleNamespace(drafts=[tmp_path]), argparse.Namespace(**{**vars(args),
                      "smartspec_forward_only": True}), SimpleNamespace(), tmp_path)
    extra = seen["scenarios"][-1]
    assert extra.name == "smartspec forward-only" and extra.speculation == "auto"
    flags = list(extra.verifier_flags)
    assert flags[flags.index("--smartspec-overhead") + 1] == "false" and "smartspec" in flags


@pytest.mark.parametrize("text", ["4,4", "", "0,2", "2,x"])
def test_smartspec_ks_must_be_distinct_lengths(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        vp._distinct_lengths(argparse.ArgumentParser(), "--smartspec-ks", text)
    assert "--smartspec-ks" in capsys.readouterr().err


def test_smartspec_ks_parsed() -> None:
    assert vp._distinct_lengths(argparse.ArgumentParser(), "--smartspec-ks", "2, 4,6") == [2, 4, 6]


def test_the_smartspec_part_reports_how_often_smartspec_was_off_and_changed_lengths() -> None:
    name = "specfleet_verifier_draft_budget"
    before = vp.Snapshot({(f"{name}_tokens_count", ()): 10.0, (f"{name}_tokens_bucket", (("le", "0.0"),)): 2.0,
                          (f"{name}_tokens_sum", ()): 30.0, (f"{name}_changes_total", ()): 1.0})
    after = vp.Snapshot({(f"{name}_tokens_count", ()): 110.0, (f"{name}_tokens_bucket", (("le", "0.0"),)): 27.0,
                         (f"{name}_tokens_sum", ()): 330.0, (f"{name}_changes_total", ()): 6.0})
    run = {"tokens_per_s": 100.0, "violated": 0.0, "slo_counted": 0.0, **vp._budget_counts(after - before)}
    assert run["budget_rounds"] == 100 and run["budget_zero"] == 25 and run["budget_changes"] == 5
    idle = {**run, "budget_rounds": 0.0, "budget_zero": 0.0, "budget_sum": 0.0, "budget_changes": 0.0}
    row = vp._summary([run, idle])
    assert row["budget_zero_share"] == 0.25 and row["budget_mean"] == 3.0 and row["budget_changes_per_100"] == 5.0
    meta = {"when": "now", "edge": "pinned"}
    text = vp.markdown({"meta": meta, "smartspec": {"smartspec": {"16": row}}})
    assert "@16: 25% of rounds at 0, mean 3.0, 5.0 changes per 100 rounds" in text
    assert "changes per 100" not in vp.markdown({"meta": meta, "smartspec": {"smartspec": {"16": vp._summary([idle])}}})


def test_slo_counts_are_the_clients_with_the_verifiers_change_over_a_run_beside() -> None:
    name = "specfleet_verifier_slo_requests_total"
    key = lambda outcome: (name, (("outcome", outcome), ("slo", "4.0")))  # noqa: E731
    before = vp.Snapshot({key("attained"): 5.0, key("violated"): 1.0})
    after = vp.Snapshot({key("attained"): 11.0, key("violated"): 3.0})
    outs = [vp.Outcome(8, 1.0, 0, 0, slo_tokens_per_s=4.0), vp.Outcome(8, 3.0, 0, 0, slo_tokens_per_s=4.0),
            vp.Outcome(8, 3.0, 0, 0)]  # met, missed (8 < 12), no class
    assert vp._slo_counts(outs, after - before) == {"violated": 0.5, "slo_counted": 2.0, "violated_at_verifier": 0.25,
                                                    "verifier_counted": 8.0}
    idle = vp._slo_counts([], before - before)
    assert idle["slo_counted"] == 0 and math.isnan(idle["violated"]) and math.isnan(idle["violated_at_verifier"])
