"""make bench-report: RESULTS.md from the latest results tables and their readings."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report import SECTIONS, render
from bench.verifier_policies import earlier_parts


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
