"""Server errors and the ONE table that maps every domain exception to an HTTP status."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from promptcache import model_runtime
from promptcache.cache_store import CacheStoreError, SchemaExistsError
from promptcache.cluster import errors as cluster
from promptcache.pml import PmlError, PmlLimitError, UnknownSchemaError

logger = logging.getLogger("promptcache.server")


class ServerError(Exception):
    """Root of the server's own errors. `headers` go on the HTTP response (e.g. Retry-After). A 5xx's
    message reaches the caller only when `is_public` (written for the caller, no internals in it)."""

    is_public = False

    def __init__(self, message: str = "", *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})


class NotReadyError(ServerError):
    """The model is still loading (or failed to: the log says why)."""

    is_public = True


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


class SchemaNotFoundError(ServerError):
    """No schema has that name."""


class SchemaTooLongError(ServerError):
    """A schema's layout needs more positions than the model has."""


class UnsupportedParameterError(ServerError):
    """A request field asks for something this server does not do."""


class InvalidParameterError(ServerError):
    """A request field's value is invalid in a way its wire schema cannot say (two keys naming one token)."""


class RequestRejectedError(ServerError):
    """The engine cannot serve this request (e.g. it needs more KV than the whole budget)."""


class ClientDisconnectedError(ServerError):
    """The client closed its connection before its response was ready; the engine's work for it was aborted."""


class EngineFailureError(ServerError):
    """The engine failed serving the request; the message is the engine's, with its error id."""

    is_public = True


# Most specific first: the first matching row wins. No row for ValueError or other builtins: a request
# path raises its package's error for bad input; anything else is a bug, a 500.
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
    (InvalidParameterError, 400, "invalid_request"),
    (RequestRejectedError, 400, "request_rejected"),
    (ClientDisconnectedError, 499, "client_closed_request"),  # nginx's status: no one receives it
    (EngineFailureError, 500, "engine_error"),
    (PmlLimitError, 413, "pml_limit_exceeded"),
    (PmlError, 400, "invalid_pml"),
    (model_runtime.PromptTooLongError, 400, "prompt_too_long"),
    (model_runtime.ChatRenderError, 400, "invalid_messages"),
    (model_runtime.InvalidRequestError, 400, "invalid_request"),
    (model_runtime.QueueFullError, 429, "queue_full"),
    (model_runtime.ModelLoadError, 503, "model_unavailable"),
    (model_runtime.EngineError, 500, "engine_error"),
    (CacheStoreError, 503, "cache_unavailable"),
    (cluster.RequestTooLargeError, 413, "payload_too_large"),
    (cluster.ReplicasBusyError, 503, "service_unavailable"),
    (cluster.ReplicaLostError, 503, "replica_lost"),
    (cluster.ReplicaStartError, 503, "service_unavailable"),
    (cluster.NoReplicaError, 503, "service_unavailable"),
    (cluster.ClusterConfigError, 500, "internal_error"),
    (cluster.ClusterError, 503, "service_unavailable"),
]


def headers_for(exc: Exception) -> dict[str, str] | None:
    """An error response's headers: a ServerError's own; Retry-After for a full queue or a cluster error naming one."""
    if isinstance(exc, ServerError):
        return exc.headers
    if isinstance(exc, (model_runtime.QueueFullError, cluster.ClusterError)) and exc.retry_after_s is not None:
        return {"Retry-After": str(exc.retry_after_s)}
    return None


def status_for(exc: Exception) -> tuple[int, str]:
    return next(((status, kind) for cls, status, kind in ERROR_TABLE if isinstance(exc, cls)), (500, "internal_error"))


def public_error(exc: Exception, where: str) -> tuple[int, str, str]:
    """(status, type, message) the caller sees for `exc`, raised while serving `where`. A 4xx says what is
    wrong; a 5xx says only what failed and an error id, and the exception goes to the log under that id
    (Redis addresses, paths and tracebacks stay server-side). Bodies and SSE error events both use it."""
    status, kind = status_for(exc)
    if status < 500 or (isinstance(exc, (ServerError, cluster.ClusterError)) and exc.is_public):
        return status, kind, str(exc)
    error_id = uuid.uuid4().hex[:12]
    logger.error("%s failed (error id %s)", where, error_id, exc_info=exc)
    what = ("internal server error" if status == 500 else
            "a cache tier or the schema registry is unavailable; retry shortly" if kind == "cache_unavailable" else
            "service unavailable; retry shortly")
    return status, kind, f"{what} (id {error_id})"


def error_response(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status, headers=headers)


def response_for(exc: Exception, where: str = "a request") -> JSONResponse:
    """The error response of a domain exception raised before any route ran (auth, limits)."""
    status, kind, message = public_error(exc, where)
    response = error_response(status, kind, message, headers_for(exc))
    if status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception through ERROR_TABLE; the body is always {"error": {"type", "message"}}."""

    async def domain(request: Request, exc: Exception) -> JSONResponse:
        status, kind, message = public_error(exc, f"{request.method} {request.url.path}")
        if status < 500:
            message = f"{type(exc).__name__}: {message}"
        return error_response(status, kind, message, headers_for(exc))

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)  # registered for it alone (Starlette types handlers loosely)
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

    async def http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(exc.status_code, "http_error", str(exc.detail))

    for cls, _, _ in ERROR_TABLE:
        app.add_exception_handler(cls, domain)
    app.add_exception_handler(Exception, domain)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http)
