"""Structured-output request fields -> one ``shared.protocol.Structured`` for the verifier.

``response_format`` (OpenAI: ``json_object``, ``json_schema``) and vLLM's ``guided_json``,
``guided_regex`` and ``guided_choice``: at most one of them per request. The verifier compiles
and enforces it (services/verifier/grammar.py); a grammar it cannot compile fails the request
with the reason.
"""

from __future__ import annotations

import json
from typing import Any

from services.coordinator.errors import invalid_request
from shared.protocol import Structured

ANY_OBJECT = '{"type": "object"}'


def structured(response_format: dict[str, Any] | None, guided_json: dict[str, Any] | str | None,
               guided_regex: str | None, guided_choice: list[str] | None) -> Structured | None:
    """The request's structured output, or None; a 400 naming the field when it is malformed."""
    asked = {name: value for name, value in (("response_format", _from_response_format(response_format)),
                                             ("guided_json", _schema(guided_json, "guided_json")),
                                             ("guided_regex", _regex(guided_regex)),
                                             ("guided_choice", _choice(guided_choice))) if value is not None}
    if len(asked) > 1:
        names = ", ".join(asked)
        raise invalid_request(f"ask for one kind of structured output, not several ({names})", list(asked)[1])
    return next(iter(asked.values()), None)


def _from_response_format(fmt: dict[str, Any] | None) -> Structured | None:
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return Structured(kind="json_schema", spec=ANY_OBJECT)
    if fmt.get("type") == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
            raise invalid_request("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                  "\"schema\": {...}}}", "response_format")
        return _schema(inner["schema"], "response_format")
    raise invalid_request(f"response_format type must be text, json_object or json_schema, got {fmt.get('type')!r}",
                          "response_format")


def _schema(schema: dict[str, Any] | str | None, param: str) -> Structured | None:
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid_request(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise invalid_request(f"{param} must be a JSON Schema object", param)
    return Structured(kind="json_schema", spec=json.dumps(schema))


def _regex(regex: str | None) -> Structured | None:
    if regex is None:
        return None
    if not regex:
        raise invalid_request("guided_regex must not be empty", "guided_regex")
    return Structured(kind="regex", spec=regex)


def _choice(choices: list[str] | None) -> Structured | None:
    if choices is None:
        return None
    if not choices or any(not c for c in choices):
        raise invalid_request("guided_choice must list at least one non-empty string", "guided_choice")
    return Structured(kind="choice", spec=json.dumps(choices))
