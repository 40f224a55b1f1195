"""OpenAI-shaped errors: one exception type, one JSON body, and the handlers that enforce them.

Clients of an OpenAI-compatible server parse ``{"error": {"message", "type", "param", "code"}}``
to decide what went wrong, so *every* failure the coordinator reports, including FastAPI's own
request validation and unexpected exceptions, leaves in that shape and never as a bare 422/500.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.log import get_logger

log = get_logger("coordinator.errors")


class ApiError(Exception):
    """A request failed in a way the client should be told about, with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        #: set on passing refusals (429, verifier busy or reconnecting 503): seconds after which a retry may succeed
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def model_not_found(requested: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{requested}' does not exist. This server serves '{served}' (see GET /v1/models).",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "Missing or incorrect API key. Send 'Authorization: Bearer <api key>'.",
        "invalid_request_error",
        None,
        "invalid_api_key",
    )


def service_unavailable(message: str, retry_after_s: int | None = None) -> ApiError:
    """503; with ``retry_after_s`` when the cause is passing (a verifier reconnecting), so that the
    client gets Retry-After and a WebSocket stays open for the retry."""
    return ApiError(503, message, "service_unavailable", None, "service_unavailable", retry_after=retry_after_s)


def too_many_requests(message: str, retry_after_s: int) -> ApiError:
    """429 as OpenAI sends it: the client should back off and retry after ``retry_after_s``."""
    return ApiError(429, message, "requests", None, "rate_limit_exceeded", retry_after=retry_after_s)


def verifier_busy(reason: str, retry_after_s: int) -> ApiError:
    """503: the verifier refused the request because its sessions or KV cache are full."""
    return ApiError(
        503,
        f"The verifier is at capacity and refused the request ({reason or 'busy'}). "
        f"Retry after {retry_after_s} s.",
        "service_unavailable",
        None,
        "verifier_busy",
        retry_after=retry_after_s,
    )


def request_timeout(seconds: float) -> ApiError:
    return ApiError(
        504,
        f"The request did not finish within {seconds:g} s and was cancelled. "
        "Ask for fewer tokens, retry later, or raise the coordinator's --request-timeout-s.",
        "timeout",
        None,
        "timeout",
    )


def internal_error(message: str) -> ApiError:
    return ApiError(500, message, "internal_error", None, "internal_error")


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages'."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return parts[0] if parts else None


async def _on_api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _param_from_loc(tuple(first.get("loc", ())))
    message = f"{param + ': ' if param else ''}{first.get('msg', 'invalid request')}"
    return invalid_request(message, param).response()


async def _on_http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    code = "not_found" if exc.status_code == 404 else None
    return ApiError(exc.status_code, str(exc.detail), type_, None, code).response()


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", path=request.url.path, error=repr(exc))
    return internal_error(f"internal error: {type(exc).__name__}: {exc}").response()


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path of ``app`` to the OpenAI error shape."""
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
