"""Structured logging: one JSON object per line on stderr, with the service name on each.

    log = get_logger("verifier.engine")
    log.info("session opened", request_id=rid, prompt_len=12)
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

_SERVICE = "specfleet"
#: credentials that libraries may print (uvicorn's debug log echoes request headers): whatever
#: follows "Bearer " is replaced before a line is written, so no token or API key is ever logged
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"',\\]+")


def redact(line: str) -> str:
    return _BEARER.sub(r"\1***", line)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "service": _SERVICE,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return redact(json.dumps(out, default=str))


class StructLogger:
    """A thin wrapper whose methods take the message plus key=value fields."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def _emit(self, level: int, msg: str, exc: bool, fields: dict[str, Any]) -> None:
        if self._log.isEnabledFor(level):
            self._log.log(level, msg, extra={"fields": fields}, exc_info=exc)

    def debug(self, msg: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, msg, False, fields)

    def info(self, msg: str, **fields: Any) -> None:
        self._emit(logging.INFO, msg, False, fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self._emit(logging.WARNING, msg, False, fields)

    def error(self, msg: str, **fields: Any) -> None:
        self._emit(logging.ERROR, msg, False, fields)

    def exception(self, msg: str, **fields: Any) -> None:
        self._emit(logging.ERROR, msg, True, fields)


def get_logger(name: str) -> StructLogger:
    return StructLogger(name)


class _StderrHandler(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is when the record comes, not as it was at set-up:
    a stderr replaced since and closed (a test's output capture) is never written to."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def setup_logging(service: str, level: str = "info") -> None:
    """Route the root logger to JSON lines on stderr. Call once at service start."""
    global _SERVICE
    _SERVICE = service
    handler = _StderrHandler()
    handler.setFormatter(_JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("websockets", "httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
