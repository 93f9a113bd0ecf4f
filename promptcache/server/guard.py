"""RequestGuard: API keys (-> the caller's tenant), request rates and the request-body limit, as plain
ASGI, before any route runs. Routes read the tenant from `request.state.tenant` (state.py).

The body limit counts the bytes actually received (chunked or not; Content-Length is only an early
rejection), buffers at most the limit, and answers 413 as soon as it is crossed. The buffered body is
replayed to the app unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import deque

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from promptcache.server.errors import PayloadTooLargeError, ServerError, UnauthorizedError, response_for
from promptcache.server.settings import ServerSettings
from promptcache.server.tenants import RequestRateLimiter, TenantDirectory

METRICS_PATH = "/metrics"
OPEN_PATHS = frozenset({"/health", METRICS_PATH})
PLAYGROUND_PREFIX = "/playground"  # static page and assets: no data; the page sends the key on its own calls


class RequestGuard:
    def __init__(self, app: ASGIApp, settings: ServerSettings, tenants: TenantDirectory,
                 rates: RequestRateLimiter) -> None:
        self.app = app
        self.max_bytes = settings.max_request_bytes
        self.tenants = tenants
        self.rates = rates  # shared with the routes, which count samples past one
        self.metrics_digest = hashlib.sha256(settings.metrics_key.encode()).digest() if settings.metrics_key else None
        self.is_metrics_closed = bool(settings.api_keys_file) and self.metrics_digest is None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            if scope["path"] not in OPEN_PATHS and not scope["path"].startswith(PLAYGROUND_PREFIX):
                tenant = self.tenants.authenticate(headers.get("authorization", ""))
                self.rates.check(tenant)
                scope.setdefault("state", {})["tenant"] = tenant
            elif scope["path"] == METRICS_PATH:
                self._check_metrics_key(headers)
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_bytes:
                raise PayloadTooLargeError(f"request body is {length} bytes; the limit is {self.max_bytes}")
            messages = await self._read_body(receive)
        except ServerError as exc:
            await response_for(exc)(scope, receive, send)
            return

        async def replay() -> Message:
            return messages.popleft() if messages else await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> deque[Message]:
        """The request's body messages, counted as they arrive; stops at the limit. A deque: a body sent
        in many small chunks is replayed in linear time (list.pop(0) moves every later chunk)."""
        messages: deque[Message] = deque()
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

    def _check_metrics_key(self, headers: Headers) -> None:
        """/metrics needs the metrics key when one is set (it is never behind the tenants' keys). Without one it
        is open, unless a keys file names tenants: its series name every tenant, so it is then closed."""
        if self.metrics_digest is None:
            if self.is_metrics_closed:
                raise UnauthorizedError("/metrics names every tenant, so with an API keys file it needs a metrics "
                                        "key and this server has none (set PROMPTCACHE_METRICS_KEY)")
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if not (hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.metrics_digest)
                and scheme.lower() == "bearer"):
            raise UnauthorizedError("/metrics needs the metrics key (send Authorization: Bearer <metrics key>)")
