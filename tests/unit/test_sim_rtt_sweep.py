"""``python -m bench sim-rtt``: the round trip against the draft length, pipelining and sessions per
drafter, on the simulator: its readings, its fleets and one small sweep end to end."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench.sim import CostSpec
from bench.sim.rtt_sweep import (
    KEEP,
    SESSIONS_K,
    Point,
    best_k,
    main,
    pipelining_gain,
    points,
    sessions_kept,
    spec_of,
)
from bench.sim.spec import number_list


def row(k: int, goodput: float, pipelined: bool = False, sessions: int = 1, rtt: float = 10.0) -> dict[str, Any]:
    return {"cost": "h100", "rtt_ms": rtt, "k": k, "pipelined": pipelined, "sessions": sessions,
            "goodput_tok_s": goodput, "per_session_tok_s": goodput / sessions}


def test_the_best_k_is_the_fastest_at_one_session_per_drafter() -> None:
    rows = [row(2, 100.0), row(4, 140.0), row(8, 120.0), row(4, 150.0, pipelined=True),
            row(8, 999.0, sessions=4), row(8, 999.0, rtt=40.0)]  # other sessions and RTTs do not count
    best = best_k(rows, "h100", 10.0, False)
    assert best is not None and best["k"] == 4
    assert best_k(rows, "cpu", 10.0, False) is None
    assert pipelining_gain(rows, "h100", 10.0) == pytest.approx(150.0 / 140.0)
    assert pipelining_gain(rows, "h100", 0.0) is None


@pytest.mark.parametrize(("rates", "want"), [
    ({1: 100.0, 2: 95.0, 4: 91.0, 8: 60.0}, 4),  # per session, by sessions per drafter
    ({1: 100.0, 2: 80.0, 4: 95.0}, 1),  # every fewer count must keep up too
    ({1: 100.0}, 1),
    ({2: 50.0, 4: 40.0}, None),  # no one-session row to compare with
])
def test_a_drafter_keeps_up_with_as_many_sessions_as_each_runs_at_90_percent(rates: dict[int, float],
                                                                            want: int | None) -> None:
    assert KEEP == 0.9
    rows = [row(SESSIONS_K, rate * n, pipelined=True, sessions=n) for n, rate in rates.items()]
    assert sessions_kept(rows, "h100", 10.0) == want


def test_the_sweep_covers_both_questions_once() -> None:
    todo = points(["h100"], [0.0, 40.0], [2, SESSIONS_K], [1, 2])
    assert len(todo) == len(set(todo)) == 2 * (2 * 2 + 1)  # the k sweep's k = 4 pipelined point is the sessions' s = 1
    assert Point("h100", 40.0, SESSIONS_K, True, 2) in todo and Point("h100", 0.0, 2, False, 1) in todo


def test_a_point_is_a_fleet_of_its_sessions_draft_length_and_round_trip() -> None:
    spec = spec_of(Point("h100", 40.0, 8, True, 4), CostSpec("h100"), drafters=3, alpha=0.8, rounds=10)
    assert len(spec.drafters) == 3 and spec.rounds == 40 and spec.policies.draft_len == 8
    d = spec.drafters[0]
    assert (d.concurrency, d.pipeline_sessions, d.rtt_s, d.alpha) == (4, 4, pytest.approx(0.04), 0.8)
    assert spec_of(Point("h100", 0.0, 2, False, 1), CostSpec("h100"), 1, 0.8, 10).drafters[0].pipeline_sessions == 0


def test_a_small_sweep_writes_its_page(tmp_path: Path) -> None:
    assert main(["--cost", "h100", "--rtt-ms", "0,40", "--draft-lens", "1,4", "--sessions", "1,4", "--drafters",
                 "2", "--rounds", "20", "--seeds", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "sim-rtt.json").read_text())
    assert len(data["rows"]) == 2 * (2 * 2 + 1)
    assert all(r["goodput_tok_s"] > 0 and r["target_only_tok_s"] > 0 for r in data["rows"])
    # a round trip is paid every round: the same fleet commits less per second over 40 ms
    fast, slow = (best_k(data["rows"], "h100", rtt, True) for rtt in (0.0, 40.0))
    assert fast is not None and slow is not None and slow["goodput_tok_s"] < fast["goodput_tok_s"]
    page = (tmp_path / "sim-rtt.md").read_text()
    assert "**Draft length**" in page and "kept at 90%" in page and (tmp_path / "sim-rtt.png").stat().st_size > 0


def test_nonsense_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:  # argparse's usage error
        main(["--cost", "tpu"])
    assert usage.value.code == 2 and "cost models are cpu, h100" in capsys.readouterr().err
    assert main(["--seeds", "0"]) == 2
    assert "--seeds" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "kind", "least", "want"), [
    ("0,10,40", float, 0, [0.0, 10.0, 40.0]),
    ("1, 4,", int, 1, [1, 4]),
    ("0", int, 1, None),  # below the least
    ("2.5", int, 1, None),  # not an int
    ("", float, 0, None),
])
def test_the_sweeps_lists_are_numbers_of_their_kind(text: str, kind: type, least: float,
                                                     want: list[float] | None) -> None:
    if want is None:
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
            number_list(text, kind, least)
    else:
        assert number_list(text, kind, least) == want


def test_the_baseline_is_the_same_fleet_without_speculation_over_the_same_time() -> None:
    spec = spec_of(Point("h100", 10.0, 4, True, 2), CostSpec("h100"), drafters=2, alpha=0.8, rounds=10)
    base = spec.target_only(1.5)
    assert (base.speculative, base.rounds, base.duration_s) == (False, None, 1.5)
    assert base.drafters == spec.drafters and base.seed == spec.seed and spec.speculative
