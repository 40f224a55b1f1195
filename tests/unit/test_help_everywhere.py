"""``--help`` exits 0 and prints usage on every command: specfleet's, each bench command's, training's."""

from __future__ import annotations

import importlib
import sys

import pytest

import bench.__main__ as bench_main
from shared import cli

SPECFLEET = ["up", "status", "verifier", "drafter", "coordinator", "make-tiny-models", "fetch-model", "import-gguf",
             "wisp-train"]


def _exit_code(run: object) -> int:
    try:
        code = run()  # type: ignore[operator]
    except SystemExit as exc:
        code = exc.code
    return int(code or 0)


@pytest.mark.parametrize("command", SPECFLEET)
def test_specfleet_commands(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(lambda: cli.main([command, "--help"])) == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_bench_usage(flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["bench", flag])
    assert bench_main.main() == 0
    assert "usage: python -m bench" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["bench"], ["bench", "nope"]], ids=["none", "unknown"])
def test_bench_without_a_command_fails(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", argv)
    assert bench_main.main() == 2
    assert "usage: python -m bench" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(bench_main.COMMANDS))
def test_bench_commands(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(bench_main.COMMANDS[command])
    assert _exit_code(lambda: module.main(["--help"])) == 0
    assert "usage:" in capsys.readouterr().out


def test_training(capsys: pytest.CaptureFixture[str]) -> None:
    from training.__main__ import build_parser

    assert _exit_code(lambda: build_parser().parse_args(["--help"])) == 0
    assert "usage: python -m training" in capsys.readouterr().out
