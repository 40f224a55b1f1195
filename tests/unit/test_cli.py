"""The ``specfleet`` command: dispatch, and how ``specfleet up`` plans and resolves its fleet."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from shared import cli
from shared.errors import ModelLoadError
from shared.up import Models, Ports, UpError, build_parser, connect_host, instructions, plan, resolve_models, up_main


def test_no_command_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: specfleet" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["-h", "--help", "help"])
def test_help(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([flag]) == 0
    out = capsys.readouterr().out
    for command in ("up", "verifier", "drafter", "coordinator", "make-tiny-models"):
        assert command in out


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve"]) == 2
    assert "unknown command 'serve'" in capsys.readouterr().err


def test_missing_service_module_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._run_service("nosuch", []) == 1
    assert "services.nosuch.main is missing" in capsys.readouterr().err


def test_up_help_lists_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["up", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--verifier-port", "--drafters", "--target", "--drafts", "--redis-url",
                 "--auth-token", "--torch-threads", "--smoke"):
        assert flag in out


@pytest.mark.parametrize("flag", ["--drafters", "--sessions-per-drafter"])
def test_up_refuses_zero_drafters_or_sessions(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert up_main([flag, "0"]) == 2
    assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err


def _model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def _fetched(state: Path, copies: bool = True) -> Path:
    """What fetch-model leaves behind for the default target (so nothing is downloaded here): the
    converted directory and, with ``copies``, the GGUF copies beside it with their cards."""
    from shared.gguf_copies import WIDTHS, copy_path
    from shared.model_import import KNOWN_MODELS, SOURCE_FILE, default_model_dir

    out = _model(default_model_dir(state))
    (out / SOURCE_FILE).write_text(json.dumps({"gguf_sha256": KNOWN_MODELS["smollm2-135m-instruct"].sha256}))
    for width in WIDTHS if copies else ():
        copy_path(out, width).write_bytes(b"GGUF")
        copy_path(out, width).with_suffix(".md").write_text("card")
    return out


def _llama_missing() -> None:
    """What shared.llama_lib.llama_cpp_module raises where llama_cpp does not import (a dependency missing)."""
    from shared.llama_lib import INSTALL_HINT

    raise ModelLoadError(f"GGUF drafts run on llama.cpp, which is not installed (No module named 'diskcache'): "
                         f"{INSTALL_HINT}")


def test_resolve_defaults_to_the_fetched_model_and_its_gguf_copies(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import shared.llama_lib
    from shared.gguf_copies import FLEET_WIDTHS, copy_path

    monkeypatch.setattr(shared.llama_lib, "llama_cpp_module", lambda: None)
    target = _fetched(tmp_path / ".specfleet")
    _model(tmp_path / "models" / "draft-small")
    want = [copy_path(target, w) for w in FLEET_WIDTHS]
    assert resolve_models("", "", tmp_path, tmp_path / ".specfleet") == Models(target, want)
    assert [p.name for p in want] == ["smollm2-135m-instruct.Q4_1.gguf", "smollm2-135m-instruct.Q8_0.gguf"]


def test_without_llama_cpp_the_fleet_falls_back_to_the_committed_drafts_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import shared.llama_lib

    monkeypatch.setattr(shared.llama_lib, "llama_cpp_module", _llama_missing)
    target = _fetched(tmp_path / ".specfleet")
    small, large = _model(tmp_path / "models" / "draft-small"), _model(tmp_path / "models" / "draft-large")
    (tmp_path / "models" / "draft-empty").mkdir()  # no config.json: not a model
    assert resolve_models("", "", tmp_path, tmp_path / ".specfleet") == Models(target, [large, small])
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "llama-cpp-build.log" in said[0] and "distilled drafts" in said[0]
    assert "which is not installed (No module named 'diskcache')" in said[0]  # the reason, not a guess


def test_resolve_without_drafts_leaves_prompt_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shared.llama_lib

    monkeypatch.setattr(shared.llama_lib, "llama_cpp_module", _llama_missing)
    target = _fetched(tmp_path / ".specfleet")
    assert resolve_models("", "", tmp_path, tmp_path / ".specfleet") == Models(target, [])


def test_resolve_an_explicit_target_takes_its_draft_siblings(tmp_path: Path) -> None:
    target = _model(tmp_path / "family" / "target")
    d2, d1 = _model(tmp_path / "family" / "draft-b"), _model(tmp_path / "family" / "draft-a")
    _model(tmp_path / "models" / "draft-large")  # the default target's drafts: not for this one
    assert resolve_models(str(target), "", tmp_path, tmp_path / ".specfleet") == Models(target, [d1, d2])


def test_resolve_explicit_flags(tmp_path: Path) -> None:
    target, draft = _model(tmp_path / "t"), _model(tmp_path / "d")
    assert resolve_models(str(target), f" {draft} ,", tmp_path, tmp_path) == Models(target, [draft])


@pytest.mark.parametrize(("target", "drafts", "fragment"),
                         [("missing", "", "not a model directory"), ("t", "nope", "not a model")])
def test_resolve_refusals(tmp_path: Path, target: str, drafts: str, fragment: str) -> None:
    _model(tmp_path / "t")
    with pytest.raises(UpError, match=fragment):
        resolve_models(str(tmp_path / target), str(tmp_path / drafts) if drafts else "", tmp_path, tmp_path)


def test_plan_without_drafts_runs_prompt_lookup_drafters() -> None:
    args = build_parser().parse_args([])
    children = dict(plan(args, Models(Path("/m/target"), []), Ports(coordinator=8000, verifier=8100)))
    for i in (1, 2):
        argv = children[f"drafter-{i}"]
        assert _flag(argv, "--model") == "/m/target" and _flag(argv, "--proposer") == "ngram"


def _plan(*flags: str) -> dict[str, list[str]]:
    args = build_parser().parse_args(list(flags))
    models = Models(Path("/m/target"), [Path("/m/draft-L1"), Path("/m/draft-L2")])
    return dict(plan(args, models, Ports(coordinator=8000, verifier=8100)))


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_plan_default_fleet() -> None:
    children = _plan()
    assert list(children) == ["verifier", "coordinator", "drafter-1", "drafter-2"]
    for name, argv in children.items():
        assert argv[:3] == [sys.executable, "-m", "shared.cli"]
        assert argv[3] == name.split("-")[0]
        assert "--auth-token" not in argv  # travels by environment, never visible in ps
    assert _flag(children["verifier"], "--port") == "8100"
    assert _flag(children["verifier"], "--model") == "/m/target"
    assert _flag(children["coordinator"], "--verifier-url") == "ws://127.0.0.1:8100/v1/frontend"
    assert _flag(children["coordinator"], "--model") == "/m/target"
    assert "--redis-url" not in children["coordinator"]
    assert [_flag(children[f"drafter-{i}"], "--model") for i in (1, 2)] == ["/m/draft-L1", "/m/draft-L2"]
    assert _flag(children["drafter-2"], "--node-id") == "drafter-2"
    assert _flag(children["drafter-1"], "--queue-url") == "ws://127.0.0.1:8000/internal/queue"
    assert _flag(children["drafter-1"], "--verifier-url") == "ws://127.0.0.1:8100/v1/drafter"
    assert _flag(children["drafter-1"], "--torch-threads") == "1"


def test_plan_round_robin_redis_and_wildcard_host() -> None:
    children = _plan("--drafters", "3", "--redis-url", "redis://127.0.0.1:6390/0", "--host", "0.0.0.0",
                     "--torch-threads", "2")
    assert _flag(children["drafter-3"], "--model") == "/m/draft-L1"
    assert _flag(children["drafter-3"], "--queue-url") == "redis://127.0.0.1:6390/0"
    assert _flag(children["coordinator"], "--redis-url") == "redis://127.0.0.1:6390/0"
    assert _flag(children["coordinator"], "--host") == "0.0.0.0"
    assert _flag(children["coordinator"], "--verifier-url") == "ws://127.0.0.1:8100/v1/frontend"
    assert _flag(children["verifier"], "--torch-threads") == "2"


def test_plan_backend_reaches_the_verifier_only() -> None:
    assert "--backend" not in _plan()["verifier"]
    children = _plan("--backend", "vllm")
    assert _flag(children["verifier"], "--backend") == "vllm"
    assert all("--backend" not in argv for name, argv in children.items() if name != "verifier")


@pytest.mark.parametrize(("host", "near"), [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("10.1.2.3", "10.1.2.3")])
def test_connect_host(host: str, near: str) -> None:
    assert connect_host(host) == near


def test_instructions_show_curl_openai_and_websocket() -> None:
    text = instructions("http://127.0.0.1:8000", "target")
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in text
    assert '"model": "target"' in text
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1"' in text
    assert "ws://127.0.0.1:8000/v1/stream" in text


def test_plan_devices() -> None:
    default = _plan()
    assert "--device" not in default["verifier"] and "--device" not in default["drafter-1"]
    gpu = _plan("--device", "cuda", "--drafter-device", "cuda:1")
    assert _flag(gpu["verifier"], "--device") == "cuda"
    assert [_flag(gpu[f"drafter-{i}"], "--device") for i in (1, 2)] == ["cuda:1", "cuda:1"]
    assert "--device" not in gpu["coordinator"]
    args = build_parser().parse_args(["--drafter-device", "cuda"])  # prompt lookup has no model to place
    lookup = dict(plan(args, Models(Path("/m/target"), []), Ports(coordinator=8000, verifier=8100)))
    assert "--device" not in lookup["drafter-1"]


def test_a_second_fetch_rewrites_the_cards_the_measurements_outdate(tmp_path: Path) -> None:
    import os

    from shared.gguf_copies import MEASURED, WIDTHS, copy_path
    from shared.model_import import fetch_model

    target = _fetched(tmp_path / ".specfleet")
    stale, fresh = (copy_path(target, w).with_suffix(".md") for w in WIDTHS[:2])
    os.utime(stale, (0, MEASURED.stat().st_mtime - 60))  # written before the measurements it shows
    assert fetch_model("smollm2-135m-instruct", tmp_path / ".specfleet") == target
    assert f"a {WIDTHS[0]} GGUF copy of smollm2-135m-instruct" in stale.read_text()
    assert fresh.read_text() == "card"  # newer than the measurements: left as it is
