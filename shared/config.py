"""Per-service dataclass configs that map to CLI flags and ``SPECFLEET_*`` environment variables.

Each field carries its help text in ``metadata["help"]``. Precedence: CLI flag > environment
variable > default. Field ``drafter_concurrency`` becomes ``--drafter-concurrency`` and
``SPECFLEET_DRAFTER_CONCURRENCY``.

    @dataclass
    class MyConfig:
        port: int = opt(8000, "TCP port to listen on")

    cfg = load_config(MyConfig, argv)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

ENV_PREFIX = "SPECFLEET_"
T = TypeVar("T")


class ConfigError(ValueError):
    """A flag or environment variable could not be parsed; the message names it."""


def url_list(value: str, flag: str) -> list[str]:
    """A comma-separated list of ws:// or wss:// URLs (several verifier replicas), all of one
    scheme; ConfigError naming ``flag`` otherwise."""
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls or not all(u.startswith(("ws://", "wss://")) for u in urls):
        raise ConfigError(f"{flag} must be a ws:// or wss:// URL (or a comma-separated list of them, one per "
                          f"verifier replica), got {value!r}")
    if len({u.partition("://")[0] for u in urls}) > 1:
        raise ConfigError(f"{flag} mixes ws:// and wss:// replicas: {value!r}")
    return urls


def opt(default: Any, help: str) -> Any:
    """A config field with help text (lists get a fresh copy per instance)."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(tp: Any) -> Any:
    """int | None -> int; list[str] -> list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return origin or tp


def _parse(raw: str, tp: Any, where: str) -> Any:
    base = _base_type(tp)
    optional = type(None) in typing.get_args(tp)
    if optional and raw.strip().lower() in ("", "none", "null"):
        return None
    try:
        if base is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if base is list:
            return [item.strip() for item in raw.split(",") if item.strip()]
        return base(raw)
    except ValueError as exc:
        raise ConfigError(f"{where}={raw!r} is not a valid {getattr(base, '__name__', base)}: {exc}") from None


def build_parser(cls: type[Any], prog: str, description: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        help_text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}; default {default!r}]"
        parser.add_argument(flag_name(f.name), dest=f.name, default=None, type=str, help=help_text)
    parser.set_defaults(_hints=hints)
    return parser


def load_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    prog: str = "specfleet",
) -> T:
    """Build ``cls`` from defaults, then ``SPECFLEET_*`` env vars, then CLI flags."""
    env = os.environ if env is None else env
    parser = build_parser(cls, prog, (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "")
    ns = parser.parse_args(list(argv) if argv is not None else [])
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        cli = getattr(ns, f.name)
        if cli is not None:
            values[f.name] = _parse(cli, hints[f.name], flag_name(f.name))
        elif env_name(f.name) in env:
            values[f.name] = _parse(env[env_name(f.name)], hints[f.name], env_name(f.name))
    return cls(**values)


def describe(cfg: Any) -> dict[str, Any]:
    """The config as a plain dict for a structured start-up log line (secrets masked)."""
    out = dataclasses.asdict(cfg)
    for key, value in out.items():
        if (key.endswith("_token") or key == "token" or "api_key" in key) and value:
            out[key] = "***"
        elif isinstance(value, str) and "://" in value and "@" in value:
            out[key] = _URL_PASSWORD.sub(r"\1***@", value)  # redis://user:password@host: the password
    return out


_URL_PASSWORD = re.compile(r"(://[^:/@]*:)[^@/]*@")
