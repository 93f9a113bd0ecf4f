"""Gateway: the application's HTTP ingress. Reads each request whole and hands it to a replica through a
deployment handle, so the request router sees the body (schema, modules, prefix text) before choosing.
(Ray's HTTP proxy routes on the URL and headers only: the body reaches a replica after it was chosen.)
A plain deployment, not a FastAPI ingress: Serve allows one of those per application, and the replicas
are it; the gateway relays the replica's ASGI messages as they come (streams included).

No model and no state: several gateways can run side by side. A request whose replica died before it
answered anything is sent again (Ray has stopped routing to the dead replica by then); a request that
was already streaming when its replica died ends there.
"""

from __future__ import annotations

import logging

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from promptcache.cluster.forwarded import ForwardedRequest
from promptcache.server.errors import PayloadTooLargeError, error_response, response_for

logger = logging.getLogger(__name__)
REPLICA_LOST = (RayActorError, ActorUnavailableError, DeploymentUnavailableError)


class Gateway:
    def __init__(self, replicas: DeploymentHandle, max_request_bytes: int = 2 << 20, max_attempts: int = 3) -> None:
        self.replicas = replicas.options(stream=True)
        self.max_request_bytes = max_request_bytes
        self.max_attempts = max_attempts

    async def __call__(self, request: Request) -> Response:
        """Serve calls this for every HTTP request; the response it returns runs `relay`."""
        return _AsgiResponse(self.relay)

    async def relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the request, forward it to the replica the router picks, relay the answer."""
        try:
            body = await self._read_body(receive)
        except PayloadTooLargeError as exc:
            await response_for(exc)(scope, receive, send)
            return
        request = ForwardedRequest.from_scope(scope, body)
        for attempt in range(1, self.max_attempts + 1):
            started = False
            try:
                async for message in self.replicas.forward.remote(request):
                    started = True
                    await send(message)
                return
            except REPLICA_LOST as exc:
                if started:
                    logger.warning("replica lost while streaming %s %s: %s", request.method, request.path, exc)
                    return
                logger.warning("replica lost before answering %s %s (attempt %d of %d): %s", request.method,
                               request.path, attempt, self.max_attempts, exc)
            except BackPressureError as exc:
                await error_response(503, "service_unavailable", f"every replica is busy: {exc}",
                                     {"Retry-After": "1"})(scope, receive, send)
                return
        await error_response(503, "service_unavailable", "no replica could serve the request; retry shortly",
                             {"Retry-After": "1"})(scope, receive, send)

    async def _read_body(self, receive: Receive) -> bytes:
        """The whole body, refusing more than the replicas' request limit (they check it again)."""
        chunks, received = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_request_bytes:
                raise PayloadTooLargeError(f"request body exceeds the limit of {self.max_request_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _AsgiResponse(Response):
    """A Starlette response that is an ASGI callable: Serve lets it send whatever it sends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)
