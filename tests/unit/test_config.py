"""Config loading: defaults < SPECFLEET_* environment < CLI flags, with clear errors."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pytest

from services.coordinator.config import CoordinatorConfig
from services.drafter.config import DrafterConfig
from services.verifier.config import VerifierConfig
from services.verifier.config import validate as validate_verifier
from services.verifier.main import main as verifier_main
from shared.config import (
    ConfigError,
    build_parser,
    describe,
    env_name,
    flag_name,
    flat,
    from_flags,
    leaves,
    load_config,
    opt,
)


@dataclass
class Demo:
    """demo service: exercises every field type."""

    port: int = opt(8000, "TCP port")
    ratio: float = opt(0.5, "a float")
    name: str = opt("alpha", "a string")
    verbose: bool = opt(False, "a bool")
    tags: list[str] = opt(["a", "b"], "a comma list")  # noqa: RUF009 - opt gives a default_factory
    limit: int | None = opt(None, "an optional int")
    auth_token: str = opt("", "a secret")


def test_names() -> None:
    assert flag_name("verifier_port") == "--verifier-port"
    assert env_name("verifier_port") == "SPECFLEET_VERIFIER_PORT"


def test_defaults() -> None:
    cfg = load_config(Demo, [], env={})
    assert cfg == Demo()
    assert (cfg.port, cfg.ratio, cfg.name, cfg.verbose, cfg.tags, cfg.limit) == (8000, 0.5, "alpha", False, ["a", "b"],
                                                                                 None)


def test_list_default_is_not_shared_between_instances() -> None:
    a, b = load_config(Demo, [], env={}), load_config(Demo, [], env={})
    a.tags.append("c")
    assert b.tags == ["a", "b"]


def test_env_overrides_default() -> None:
    cfg = load_config(Demo, [], env={"SPECFLEET_PORT": "9000", "SPECFLEET_NAME": "beta"})
    assert (cfg.port, cfg.name) == (9000, "beta")


def test_cli_beats_env() -> None:
    cfg = load_config(Demo, ["--port", "9100"], env={"SPECFLEET_PORT": "9000"})
    assert cfg.port == 9100


def test_unrelated_env_is_ignored() -> None:
    assert load_config(Demo, [], env={"PORT": "1", "SPECFLEET_OTHER": "x"}) == Demo()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("false", False), ("No", False),
     ("off", False), (" true ", True)],
)
def test_bool_parsing(raw: str, expected: bool) -> None:
    assert load_config(Demo, ["--verbose", raw], env={}).verbose is expected
    assert load_config(Demo, [], env={"SPECFLEET_VERBOSE": raw}).verbose is expected


@pytest.mark.parametrize(("raw", "expected"), [("x,y", ["x", "y"]), (" x , y ,", ["x", "y"]), ("", []), ("z", ["z"])])
def test_list_parsing(raw: str, expected: list[str]) -> None:
    assert load_config(Demo, ["--tags", raw], env={}).tags == expected


@pytest.mark.parametrize(("raw", "expected"), [("5", 5), ("none", None), ("", None), ("NULL", None)])
def test_optional_parsing(raw: str, expected: int | None) -> None:
    assert load_config(Demo, ["--limit", raw], env={}).limit == expected


def test_float_parsing() -> None:
    assert load_config(Demo, ["--ratio", "1e-3"], env={}).ratio == pytest.approx(1e-3)


def test_bad_int_flag_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match=r"--port='eighty' is not a valid int"):
        load_config(Demo, ["--port", "eighty"], env={})


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"SPECFLEET_PORT='8k' is not a valid int"):
        load_config(Demo, [], env={"SPECFLEET_PORT": "8k"})


@pytest.mark.parametrize(("flag", "raw"), [("--verbose", "maybe"), ("--ratio", "fast"), ("--limit", "1.5")])
def test_other_bad_values(flag: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        load_config(Demo, [flag, raw], env={})


def test_unknown_flag_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_config(Demo, ["--nope", "1"], env={})
    assert info.value.code == 2
    assert "unrecognized arguments: --nope" in capsys.readouterr().err


def test_help_lists_env_var_and_default() -> None:
    text = build_parser(Demo, "specfleet demo", "demo").format_help()
    assert "--port" in text and "SPECFLEET_PORT" in text and "default 8000" in text


def test_describe_masks_secrets_only() -> None:
    out = describe(load_config(Demo, ["--auth-token", "s3cret"], env={}))
    assert out["auth_token"] == "***"
    assert out["name"] == "alpha"
    assert describe(Demo())["auth_token"] == ""  # an empty secret stays visibly empty


@pytest.mark.parametrize("cls", [VerifierConfig, DrafterConfig, CoordinatorConfig])
def test_service_configs_load_and_document_every_field(cls: type) -> None:
    cfg = load_config(cls, [], env={})
    for name, (_, f, _) in leaves(cls).items():
        assert f.metadata.get("help"), f"{cls.__name__}: --{name} has no help text"
    assert describe(cfg)["auth_token"] == ""
    help_text = build_parser(cls, "specfleet").format_help()
    assert "SPECFLEET_AUTH_TOKEN" in help_text


@pytest.mark.parametrize("cls", [VerifierConfig, DrafterConfig, CoordinatorConfig])
def test_service_configs_come_in_sections_of_at_most_eight_flags(cls: type) -> None:
    sections = dataclasses.fields(cls)
    assert 1 < len(sections) <= 8 and all(s.metadata.get("section") for s in sections)
    for s in sections:
        flags = dataclasses.fields(getattr(cls(), s.name))
        assert 0 < len(flags) <= 8, f"{cls.__name__}.{s.name} has {len(flags)} flags"


def test_a_sectioned_config_keeps_every_flag_and_variable_name() -> None:
    cfg = load_config(VerifierConfig, ["--port", "9", "--allocation", "goodspeed"], env={"SPECFLEET_TRIM": "adaspec"})
    assert (cfg.server.port, cfg.budgets.allocation, cfg.batches.trim) == (9, "goodspeed", "adaspec")
    assert cfg == from_flags(VerifierConfig, port=9, allocation="goodspeed", trim="adaspec")
    assert flat(cfg)["port"] == 9 and describe(cfg)["trim"] == "adaspec"
    with pytest.raises(TypeError, match="no flag prot"):
        from_flags(VerifierConfig, prot=9)
    help_text = build_parser(VerifierConfig, "specfleet verifier").format_help()
    assert "draft-length allocation (GoodSpeed, SmartSpec):" in help_text and "--smartspec-max-len" in help_text


# --- the verifier's flags: one validation, one ConfigError, before any model is loaded ------------


def test_the_verifiers_defaults_with_a_model_are_valid() -> None:
    validate_verifier(from_flags(VerifierConfig, model="/some/dir"))
    # zeros that mean something: SmartSpec with no length but 0 (speculation off), any free port
    validate_verifier(from_flags(VerifierConfig, model="/some/dir", allocation="smartspec", smartspec_max_len=0, port=0,
                                     max_draft_tokens=0, kv_cache_gb=0.0, max_model_len=0))


@pytest.mark.parametrize(("flags", "message"), [
    ({}, "no target model given: pass --model DIR"),
    ({"backend": "tensorrt"}, "--backend must be one of torch, vllm, got 'tensorrt'"),
    ({"sampling": "greedy"}, "--sampling must be one of race, stream"),
    ({"core_mode": "fast"}, "--core-mode must be one of auto, thread, inline"),
    ({"matmul": "mkl"}, "--matmul must be one of auto, rowwise, onednn, plain"),
    ({"allocation": "goodput"}, "--allocation must be one of fixed, random, goodspeed, smartspec"),
    ({"batching": "edf"}, "--batching must be one of fcfs, wisp"),
    ({"trim": "tail"}, "--trim must be one of none, adaspec"),
    ({"dtype": "int8"}, "--dtype must be one of auto, float32, float16, bfloat16"),
    ({"drafter_trust": "maybe"}, "--drafter-trust must be one of trusted, untrusted"),
    ({"ws_ping_timeout_s": 0.0}, "--ws-ping-timeout-s must be > 0, got 0.0"),
    ({"max_batch_tokens": -1}, "--max-batch-tokens must be > 0"),
    ({"kv_cache_gb": -2.0}, "--kv-cache-gb must be >= 0"),
    ({"tls_cert": "cert.pem"}, "--tls-cert and --tls-key go together"),
    ({"backend": "vllm", "trim": "adaspec"}, "--batching, --trim and --recompute-context apply to the torch"),
])
def test_each_bad_verifier_flag_is_named(flags: dict[str, object], message: str) -> None:
    cfg = from_flags(VerifierConfig, **{"model": "/some/dir", **flags})  # type: ignore[arg-type]
    if not flags:
        cfg.target.model = ""
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_verifier(cfg)


def test_every_problem_is_reported_at_once() -> None:
    cfg = from_flags(VerifierConfig, backend="tpu", max_sessions=0, trim="tail")
    with pytest.raises(ConfigError) as info:
        validate_verifier(cfg)
    said = str(info.value)
    for flag in ("--backend", "--max-sessions", "--trim", "no target model"):
        assert flag in said, said


def test_the_verifier_refuses_a_bad_flag_before_loading_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert verifier_main(["--model", "/nowhere", "--batching", "edf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specfleet verifier: --batching must be one of fcfs, wisp, got 'edf'"), err
    assert "/nowhere" not in err  # the model was never looked at
