"""The SDK's error tree, mirroring HTTP statuses."""

from __future__ import annotations

from typing import Any


class PromptCacheError(Exception):
    """Root of every SDK error."""


class APIConnectionError(PromptCacheError):
    """The server could not be reached."""


class APITimeoutError(APIConnectionError):
    """The request timed out."""


class APIStatusError(PromptCacheError):
    """The server answered with an error status; `type` and `message` come from its error body."""

    def __init__(self, status_code: int, type: str, message: str, body: Any = None) -> None:
        super().__init__(f"{status_code} {type}: {message}")
        self.status_code = status_code
        self.type = type
        self.message = message
        self.body = body


class BadRequestError(APIStatusError):
    """400: invalid PML, a prompt that does not fit its schema, unsupported parameters."""


class AuthenticationError(APIStatusError):
    """401."""


class NotFoundError(APIStatusError):
    """404: unknown schema."""


class ConflictError(APIStatusError):
    """409: a schema of that name exists (also after a retried create that had succeeded)."""


class PayloadTooLargeError(APIStatusError):
    """413."""


class UnprocessableEntityError(APIStatusError):
    """422: the request body does not match the API."""


class RateLimitError(APIStatusError):
    """429."""


class InternalServerError(APIStatusError):
    """5xx."""


class ServiceUnavailableError(InternalServerError):
    """503: the model is still loading, or a backend is down."""


_BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 404: NotFoundError, 409: ConflictError,
              413: PayloadTooLargeError, 422: UnprocessableEntityError, 429: RateLimitError,
              503: ServiceUnavailableError}


def error_for(status_code: int, body: Any) -> APIStatusError:
    """The exception for an error response (`body` is the decoded JSON or text)."""
    error = body.get("error", {}) if isinstance(body, dict) else {}
    kind = error.get("type", "error") if isinstance(error, dict) else "error"
    message = error.get("message", str(body)) if isinstance(error, dict) else str(body)
    cls = _BY_STATUS.get(status_code, InternalServerError if status_code >= 500 else APIStatusError)
    return cls(status_code, kind, message, body)
