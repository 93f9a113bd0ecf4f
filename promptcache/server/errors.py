"""Server errors and the ONE table that maps every domain exception to an HTTP status."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from promptcache.cache_store import CacheStoreError
from promptcache.cache_store import SchemaExistsError as StoreSchemaExistsError
from promptcache.model_runtime.errors import ChatRenderError, EngineError, ModelLoadError, PromptTooLongError
from promptcache.pml import PmlError, PmlLimitError, UnknownSchemaError

logger = logging.getLogger("promptcache.server")


class ServerError(Exception):
    """Root of the server's own errors. `headers` go on the HTTP response (e.g. Retry-After)."""

    def __init__(self, message: str = "", *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})


class NotReadyError(ServerError):
    """The model is still loading."""


class UnauthorizedError(ServerError):
    """Missing or invalid API key."""


class RateLimitedError(ServerError):
    """The tenant sent more requests than its rate allows."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class QuotaExceededError(ServerError):
    """The tenant's schemas would exceed its quota (count or tokens)."""


class PayloadTooLargeError(ServerError):
    """The request body exceeds the configured limit."""


class SchemaExistsError(ServerError):
    """A schema with that name is already loaded."""


class SchemaNotFoundError(ServerError):
    """No schema has that name."""


class SchemaTooLongError(ServerError):
    """A schema's layout needs more positions than the model has."""


class UnsupportedParameterError(ServerError):
    """A request field asks for something this server does not do."""


class RequestRejectedError(ServerError):
    """The engine cannot serve this request (e.g. it needs more KV than the whole budget)."""


class EngineFailureError(ServerError):
    """The engine failed while serving the request."""


# Most specific first: the first matching row wins.
ERROR_TABLE: list[tuple[type[Exception], int, str]] = [
    (UnauthorizedError, 401, "authentication_error"),
    (NotReadyError, 503, "service_unavailable"),
    (PayloadTooLargeError, 413, "payload_too_large"),
    (RateLimitedError, 429, "rate_limit_exceeded"),
    (QuotaExceededError, 429, "quota_exceeded"),
    (SchemaExistsError, 409, "schema_exists"),
    (SchemaNotFoundError, 404, "schema_not_found"),
    (SchemaTooLongError, 400, "schema_too_long"),
    (UnknownSchemaError, 404, "schema_not_found"),
    (UnsupportedParameterError, 400, "unsupported_parameter"),
    (RequestRejectedError, 400, "request_rejected"),
    (EngineFailureError, 500, "engine_error"),
    (StoreSchemaExistsError, 409, "schema_exists"),
    (PmlLimitError, 413, "pml_limit_exceeded"),
    (PmlError, 400, "invalid_pml"),
    (PromptTooLongError, 400, "prompt_too_long"),
    (ChatRenderError, 400, "invalid_messages"),
    (ModelLoadError, 503, "model_unavailable"),
    (EngineError, 500, "engine_error"),
    (CacheStoreError, 503, "cache_unavailable"),
    (ValueError, 400, "invalid_request"),
]


def status_for(exc: Exception) -> tuple[int, str]:
    for cls, status, kind in ERROR_TABLE:
        if isinstance(exc, cls):
            return status, kind
    return 500, "internal_error"


def error_response(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status, headers=headers)


def response_for(exc: Exception) -> JSONResponse:
    """The error response of a domain exception raised before any route ran (auth, limits)."""
    status, kind = status_for(exc)
    response = error_response(status, kind, str(exc), exc.headers if isinstance(exc, ServerError) else None)
    if status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception through ERROR_TABLE; the body is always {"error": {"type", "message"}}."""

    async def domain(request: Request, exc: Exception) -> JSONResponse:
        status, kind = status_for(exc)
        if status < 500:
            return error_response(status, kind, f"{type(exc).__name__}: {exc}",
                                  exc.headers if isinstance(exc, ServerError) else None)
        if status == 503 or isinstance(exc, EngineFailureError):  # messages written for the caller
            return error_response(status, kind, str(exc))
        error_id = uuid.uuid4().hex[:12]  # internals go to the log only, under an id the caller gets
        logger.error("%s %s failed (error id %s)", request.method, request.url.path, error_id, exc_info=exc)
        return error_response(status, kind, f"internal server error (id {error_id})")

    async def validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts, unknown = [], []
        for error in exc.errors():
            where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
            if error.get("type") == "extra_forbidden":
                unknown.append(where)
            else:
                parts.append(f"{where or 'body'}: {error.get('msg')}")
        if unknown and not parts:  # a field we do not know is a feature we do not have: never ignored
            return error_response(400, "unsupported_parameter",
                                  f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: not "
                                  f"supported by this server (see docs/api.md for the fields each route takes)")
        parts += [f"{where}: unknown field" for where in unknown]
        return error_response(422, "invalid_request", "; ".join(parts))

    async def http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, "http_error", str(exc.detail))

    for cls, _, _ in ERROR_TABLE:
        app.add_exception_handler(cls, domain)
    app.add_exception_handler(Exception, domain)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http)
