"""``specfleet status``: its tables from a /v1/fleet view, and its exit codes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from rich.console import Console

from shared.status_cli import render, status_main

VIEW: dict[str, Any] = {
    "time": 1.0, "coordinator": "coordinator-a", "status": "ready", "missing": [],
    "verifiers": [{"url": "ws://v:8100/v1/frontend", "up": True, "error": "", "ready": True,
                   "engine": {"backend": "torch", "model": "smollm2", "dtype": "bfloat16", "device": "cpu"},
                   "policies": {}, "kv": {"reserved_bytes": 3 * 2**20, "free_bytes": 2**31}, "sessions": 2,
                   "step_ms": 25.0, "batch_sessions": 2.0, "tokens_s": 80.0, "tokens_per_forward": 2.5}],
    "drafters": [{"verifier": "ws://v", "node": "edge-7", "model": "draft", "sessions": 2, "acceptance": 0.71,
                  "drafted_tokens_s": 120.0, "rtt_ms": 12.5, "budget": 4.0, "trusted": False,
                  "connected_since": 0.0}],
    "requests": {"in_flight": 2, "queued": None, "rejected_429": 3},
    "speed": {"tokens_s": 80.0, "ttft_p50_s": 0.05, "ttft_p99_s": 0.2, "tpot_p50_s": 0.012, "tpot_p99_s": 0.02,
              "tokens_per_forward": 2.5, "speedup_estimate": 2.3, "speedup_method": ""},
}


def shown(view: dict[str, Any]) -> str:
    console = Console(width=200, record=True)
    console.print(render(view))
    return console.export_text()


def test_a_ready_fleet() -> None:
    out = shown(VIEW)
    for expected in ("READY", "edge-7", "71 %", "12.5 ms", "no (ids only)", "2.30×", "3.0 MiB / 2.0 GiB",
                     "bfloat16", "unknown"):
        assert expected in out, expected


def test_a_broken_fleet() -> None:
    view = copy.deepcopy(VIEW)
    view.update(status="not_ready", missing=["verifier link is down: refused"], drafters=[])
    view["verifiers"] = [{"url": "ws://v", "up": False, "error": "cannot read http://v/fleet"}]
    out = shown(view)
    for expected in ("NOT READY", "verifier link is down", "unreachable", "cannot read http://v/fleet",
                     "no drafter connected"):
        assert expected in out, expected


@pytest.mark.parametrize(("argv", "code"), [
    (["--url", "http://127.0.0.1:1"], 1),  # nothing listens: not ready, with the reason
    (["--interval", "0"], 2),
    (["--bogus"], 2),
])
def test_exit_codes(argv: list[str], code: int, capsys: pytest.CaptureFixture[str]) -> None:
    if code == 2:
        with pytest.raises(SystemExit) as info:
            status_main(argv)
        assert info.value.code == 2
    else:
        assert status_main(argv) == code
        assert "cannot reach the coordinator" in capsys.readouterr().err


def test_help_exits_zero() -> None:
    with pytest.raises(SystemExit) as info:
        status_main(["--help"])
    assert info.value.code == 0
