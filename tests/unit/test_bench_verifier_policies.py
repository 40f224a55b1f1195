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


def _trim_args(**over: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"trim_ks": [2, 6], "trim_loads": [1, 16], "trim_fleet": "one", "max_tokens": 8,
                                 "repeats": 1, "estimator_file": "", **over})


def _trim_scenarios(monkeypatch: pytest.MonkeyPatch, models: Any, args: argparse.Namespace,
                    tmp_path: Path) -> list[Any]:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(vp, "serve_loads", lambda models, scs, loads, *rest: seen.update(scs=scs, loads=loads) or {})
    vp.trim_part(models, args, SimpleNamespace(), tmp_path)
    assert seen["loads"] == args.trim_loads
    return list(seen["scs"])


def test_the_trim_part_runs_target_only_the_fixed_ks_and_adaspec_on_one_drafter(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(vp, "smallest", lambda drafts: drafts[0])
    scs = _trim_scenarios(monkeypatch, SimpleNamespace(drafts=[tmp_path / "q4"]), _trim_args(), tmp_path)
    assert [sc.name for sc in scs] == ["target-only", "fixed k=2", "fixed k=6", "adaspec trim (k=6)",
                                       "adaspec drafter + trim (k=6)"]
    assert scs[0].drafters == 0 and all(sc.drafters == 1 and sc.draft == str(tmp_path / "q4") for sc in scs[1:])
    assert [sc.draft_len for sc in scs[1:]] == [2, 6, 6, 6]
    trim, whole = scs[3], scs[4]
    assert "--send-confidence" in trim.drafter_flags and "--controller" not in trim.drafter_flags
    assert list(whole.drafter_flags) == ["--controller", "adaspec"]
    assert all(list(sc.verifier_flags[:2]) == ["--trim", "adaspec"] for sc in (trim, whole))
    assert not any("--trim" in sc.verifier_flags for sc in scs[:3])


def test_the_trim_parts_mixed_fleet_is_four_drafters_of_different_acceptance_sharing_the_load(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "smollm2"
    target.mkdir()
    monkeypatch.chdir(tmp_path)
    models = SimpleNamespace(target=target, drafts=[])
    with pytest.raises(SystemExit, match=r"smollm2\.Q4_1\.gguf.*fetch-model"):
        _trim_scenarios(monkeypatch, models, _trim_args(trim_fleet="mixed"), tmp_path)
    for width in ("Q4_1", "Q4_0"):
        (tmp_path / f"smollm2.{width}.gguf").write_bytes(b"")
    (tmp_path / "models" / "draft-small").mkdir(parents=True)
    scs = _trim_scenarios(monkeypatch, models, _trim_args(trim_fleet="mixed", trim_loads=[4, 14]), tmp_path)
    assert scs[0].drafters == 0
    for sc in scs[1:]:
        copies = [str(tmp_path / f"smollm2.{width}.gguf") for width in ("Q4_1", "Q4_0")]
        assert sc.drafters == 4 and sc.drafts == (*copies, "models/draft-small", str(target))
        # each drafter takes at most a quarter of the largest load (rounded up); the fourth drafts by prompt lookup
        assert [list(f) for f in sc.per_drafter_flags] == [["--max-sessions", "4"]] * 3 + [
            ["--max-sessions", "4", "--proposer", "ngram"]]


def test_the_trim_parts_readings_come_from_every_repeat() -> None:
    def run(rate: float, drafted: int, accepted: int, trimmed: float) -> dict[str, float]:
        return {"tokens_per_s": rate, "violated": float("nan"), "slo_counted": 0.0, "drafted": drafted,
                "accepted": accepted, "trimmed": trimmed, "wall_s": 10.0, "verifier_steps_s": 9.0,
                "draft_busy_s": 4.0}
    row = vp._summary([run(100.0, 60, 30, 10.0), run(120.0, 40, 30, 0.0)])
    assert row["acceptance"] == 0.6 and row["trimmed_share"] == pytest.approx(10 / 110)
    assert row["verifier_busy"] == 0.9 and row["draft_busy"] == 0.4 and row["tokens_per_s"] == 110.0
    base = vp._summary([run(100.0, 0, 0, 0.0)])
    assert math.isnan(base["acceptance"]) and math.isnan(base["trimmed_share"])
    meta = {"when": "now", "edge": "pinned", "parts": {"trim": {"command": "python -m bench verifier-policies x"}}}
    text = vp.markdown({"meta": meta, "trim": {"target-only": {"16": base}, "adaspec trim (k=6)": {"16": row}}})
    assert "`python -m bench verifier-policies x`" in text and "| adaspec trim (k=6) | 110.0 (1.10x) |" in text
    assert "adaspec trim (k=6) @16: acceptance 0.60, trimmed 9%, verifier busy 0.90" in text
    assert "target-only @16" not in text
