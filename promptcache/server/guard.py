"""RequestGuard: API keys and the request-body limit, as plain ASGI, before any route runs.

The body limit counts the bytes actually received (chunked or not; Content-Length is only an early
rejection), buffers at most the limit, and answers 413 as soon as it is crossed. The buffered body is
replayed to the app unchanged.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from promptcache.server.errors import PayloadTooLargeError, UnauthorizedError, error_response, status_for
from promptcache.server.settings import ServerSettings

OPEN_PATHS = frozenset({"/health", "/metrics"})


class RequestGuard:
    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.max_bytes = settings.max_request_bytes
        self.keys = [k.encode() for k in settings.api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            if scope["path"] not in OPEN_PATHS:
                self._authenticate(headers)
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_bytes:
                raise PayloadTooLargeError(f"request body is {length} bytes; the limit is {self.max_bytes}")
            messages = await self._read_body(receive)
        except (UnauthorizedError, PayloadTooLargeError) as exc:
            status, kind = status_for(exc)
            response = error_response(status, kind, str(exc))
            if status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> list[Message]:
        """The request's body messages, counted as they arrive; stops at the limit."""
        messages: list[Message] = []
        received = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # a disconnect: the app sees it
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise PayloadTooLargeError(f"request body exceeds the limit of {self.max_bytes} bytes")
            if not message.get("more_body", False):
                return messages

    def _authenticate(self, headers: Headers) -> None:
        if not self.keys:
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), k) for k in self.keys):
            raise UnauthorizedError("missing or invalid API key (send Authorization: Bearer <key>)")
