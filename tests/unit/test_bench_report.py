"""make bench-report: RESULTS.md from the latest results tables and their readings."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report import SECTIONS, render, when
from bench.verifier_policies import _summary, _table, earlier_parts


def test_every_section_shows_its_latest_table_or_says_it_was_not_run(tmp_path: Path) -> None:
    results, commentary = tmp_path / "results", tmp_path / "commentary"
    results.mkdir()
    commentary.mkdir()
    (results / "rtt.md").write_text("Command: `python -m bench rtt`\n\n# Sub\n\n| a |\n|---|\n| 1 |\n")
    (results / "rtt.json").write_text(json.dumps({"meta": {"when": "2026-11-23 16:23"}, "rows": []}))
    (results / "rtt.png").write_bytes(b"png")
    (commentary / "rtt.md").write_text("Longer RTT favours longer drafts.\n")
    (commentary / "_intro.md").write_text("The machine.\n")
    text = render(results, commentary)
    assert text.startswith("# Benchmark results") and "The machine." in text
    rtt = text[text.index("## Speculation over an emulated edge network"):]
    assert "Latest run: 2026-11-23 16:23." in rtt and "| 1 |" in rtt and "### Sub" in rtt
    assert "![rtt.png](results/rtt.png)" in rtt and "Longer RTT favours longer drafts." in rtt
    for s in SECTIONS:
        if s.stem != "rtt":
            assert f"Not run yet: `{s.command}`." in text


def test_the_committed_results_render(tmp_path: Path) -> None:
    here = Path(__file__).parents[2] / "bench"
    text = render(here / "results", here / "commentary")
    assert "Not run yet" not in text  # every benchmark has a committed latest run


def test_a_run_of_some_verifier_policy_parts_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "verifier-policies.json"
    old = {"meta": {"when": "w", "parts": {"trim": {"when": "2026-11-23 14:55"}, "wisp": {"when": "2026-11-23 15:01"}}},
           "trim": {"fixed k=2": {}}, "wisp": {"fcfs": {}}}
    path.write_text(json.dumps(old))
    kept = earlier_parts(path, ["trim"])
    assert set(kept) == {"meta", "wisp"} and kept["wisp"] == {"fcfs": {}}
    assert kept["meta"]["parts"] == {"wisp": {"when": "2026-11-23 15:01"}}
    assert earlier_parts(tmp_path / "absent.json", ["trim"]) == {"meta": {"parts": {}}}
    legacy = {"meta": {"when": "2026-11-23 14:55"}, "smartspec": {"x": {}}}  # written before meta.parts existed
    path.write_text(json.dumps(legacy))
    assert earlier_parts(path, ["trim"])["meta"]["parts"] == {"smartspec": {"when": "2026-11-23 14:55"}}


def test_load_tables_report_medians_and_ratios_paired_by_repeat() -> None:
    """Each repeat runs every scenario back to back; a ratio is taken within a repeat, then the
    median across repeats, so a slow minute of the machine does not favour one scenario."""
    base = _summary([{"tokens_per_s": r, "violated": 0.0, "slo_counted": 8.0} for r in (100.0, 200.0, 300.0)])
    spec = _summary([{"tokens_per_s": r, "violated": v, "slo_counted": 8.0}
                     for r, v in ((250.0, 0.5), (210.0, 0.0), (290.0, 0.25))])
    assert base["tokens_per_s"] == 200.0 and spec["tokens_per_s"] == 250.0
    assert spec["violated"] == (4 + 0 + 2) / 24  # pooled over the repeats' finished requests
    table = _table({"target-only": {4: base}, "smartspec": {4: spec}}, "tokens_per_s", ratio=True)
    assert table[-1] == "| smartspec | 250.0 (1.05x) |"  # median of 2.5, 1.05, 0.97; medians' ratio: 1.25


def test_when_falls_back_to_the_time_the_table_names(tmp_path: Path) -> None:
    (tmp_path / "x.md").write_text("Collected by `python -m bench x` (2026-11-23 13:49; pinned).\n\n| a |\n")
    (tmp_path / "x.json").write_text(json.dumps({"meta": {"command": "x"}}))  # no meta.when
    assert when(tmp_path, "x") == "2026-11-23 13:49"
