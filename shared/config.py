"""Per-service dataclass configs that map to CLI flags and ``SPECFLEET_*`` environment variables.

Each field carries its help text in ``metadata["help"]``. Precedence: CLI flag > environment
variable > default. Field ``drafter_concurrency`` becomes ``--drafter-concurrency`` and
``SPECFLEET_DRAFTER_CONCURRENCY``.

A service's config is made of sections: a top-level dataclass whose fields are dataclasses
(``section(...)``), each holding a few flags. Flag and variable names come from the leaf field
alone (``cfg.server.port`` is ``--port``), so leaf names are unique across a config's sections,
and ``--help`` lists the flags section by section. A config of plain fields works the same.

    @dataclass
    class Server:  # its docstring titles the section in --help
        port: int = opt(8000, "TCP port to listen on")

    @dataclass
    class MyConfig:
        server: Server = section(Server)

    cfg = load_config(MyConfig, argv)       # --port / SPECFLEET_PORT -> cfg.server.port
    cfg = from_flags(MyConfig, port=9000)   # the same from flat names (tests, embedding)
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


def section(cls: type[T]) -> T:
    """A config section: a dataclass of flags, each with its default."""
    return dataclasses.field(default_factory=cls, metadata={"section": True})


def sections(cls: type[Any]) -> list[tuple[str | None, type[Any]]]:
    """(attribute, dataclass) of each section; (None, cls) for a config of plain fields."""
    fields = dataclasses.fields(cls)
    if fields and all(f.metadata.get("section") for f in fields):
        hints = typing.get_type_hints(cls)
        return [(f.name, hints[f.name]) for f in fields]
    return [(None, cls)]


def leaves(cls: type[Any]) -> dict[str, tuple[str | None, dataclasses.Field[Any], Any]]:
    """Every flag of a config: leaf name -> (its section's attribute, its field, its type)."""
    out: dict[str, tuple[str | None, dataclasses.Field[Any], Any]] = {}
    for name, sec in sections(cls):
        hints = typing.get_type_hints(sec)
        for f in dataclasses.fields(sec):
            if f.name in out:
                raise TypeError(f"{cls.__name__}: flag {f.name!r} is in two sections")
            out[f.name] = (name, f, hints[f.name])
    return out


def from_flags(cls: type[T], **values: Any) -> T:
    """Build a config from flat flag names (``from_flags(VerifierConfig, port=0)``); the rest default."""
    known = leaves(cls)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise TypeError(f"{cls.__name__} has no flag {', '.join(unknown)}")
    found = sections(cls)
    if found == [(None, cls)]:
        return cls(**values)
    parts = {str(name): sec(**{k: v for k, v in values.items() if known[k][0] == name}) for name, sec in found}
    return cls(**parts)


def flat(cfg: Any) -> dict[str, Any]:
    """A config's flags as leaf name -> value."""
    return {name: getattr(cfg if where is None else getattr(cfg, where), name)
            for name, (where, _, _) in leaves(type(cfg)).items()}


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
    for name, sec in sections(cls):
        group = parser if name is None else parser.add_argument_group((sec.__doc__ or name).strip().splitlines()[0])
        for f in dataclasses.fields(sec):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
            help_text = f"{f.metadata.get('help', '')} [env {env_name(f.name)}; default {default!r}]"
            group.add_argument(flag_name(f.name), dest=f.name, default=None, type=str, help=help_text)
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
    values: dict[str, Any] = {}
    for name, (_, _, hint) in leaves(cls).items():
        cli = getattr(ns, name)
        if cli is not None:
            values[name] = _parse(cli, hint, flag_name(name))
        elif env_name(name) in env:
            values[name] = _parse(env[env_name(name)], hint, env_name(name))
    return from_flags(cls, **values)


def describe(cfg: Any) -> dict[str, Any]:
    """The config as a plain dict for a structured start-up log line (secrets masked)."""
    out = flat(cfg)
    for key, value in out.items():
        if (key.endswith("_token") or key == "token" or "api_key" in key) and value:
            out[key] = "***"
        elif isinstance(value, str) and "://" in value and "@" in value:
            out[key] = _URL_PASSWORD.sub(r"\1***@", value)  # redis://user:password@host: the password
    return out


_URL_PASSWORD = re.compile(r"(://[^:/@]*:)[^@/]*@")
