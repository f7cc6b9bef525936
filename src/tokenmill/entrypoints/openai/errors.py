"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``, and the
mapping from engine exceptions and framework errors to them."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.errors import (
    ContextLengthError,
    DrainingError,
    EngineDeadError,
    QueueFullError,
    QueueTimeoutError,
    TokenmillError,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""Seconds a client refused with 429 is told to wait (the Retry-After header)."""


class APIError(Exception):
    """An error answered with an OpenAI error object and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, type="service_unavailable_error", code=code)


def from_exception(exc: BaseException) -> APIError:
    """Engine exception -> API error (400 for any ValueError, with the engine's message)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(
            429,
            str(exc),
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, QueueTimeoutError):
        return unavailable(str(exc), "queue_timeout")
    if isinstance(exc, DrainingError):
        return unavailable(str(exc), "draining")
    if isinstance(exc, EngineDeadError):
        return unavailable(str(exc), "engine_dead")
    if isinstance(exc, ContextLengthError):
        return bad_request(str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    logger.error("internal error", exc_info=exc)
    return APIError(
        500,
        f"internal error: {type(exc).__name__}: {exc}",
        type="server_error",
        code="internal_error",
    )


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first pydantic error as 'field: what is wrong', and the field's name."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        return f"the body is not valid JSON: {err.get('msg', '')}", None
    if not loc:
        return "the request body must be a JSON object (it is empty or something else)", None
    where = ".".join(loc)
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{where}: {err.get('msg', 'invalid value')}{more}" if where else err.get("msg", ""), (
        loc[0] if loc else None
    )


def install_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error object; never FastAPI's 422."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return bad_request(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    # ValueError/TokenmillError are answered here; only other exceptions reach the
    # Exception handler (which Starlette also logs and re-raises as a 500).
    @app.exception_handler(ValueError)
    @app.exception_handler(TokenmillError)
    @app.exception_handler(Exception)
    async def _engine_error(_: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()
