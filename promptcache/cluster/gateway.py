"""Gateway: the application's HTTP ingress. It reads each request whole and hands it to a replica through a
deployment handle, so the request router sees the body before choosing (Ray's HTTP proxy routes on URL and
headers only), then relays the replica's ASGI messages as they come (docs/scaling.md). No model, no state.
A plain deployment, not a FastAPI ingress: Serve allows one of those per application, and the replicas are it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, cast

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from promptcache.cluster.errors import ClusterError, ReplicaLostError, ReplicasBusyError, RequestTooLargeError
from promptcache.cluster.forwarded import ForwardedRequest
from promptcache.cluster.readiness import ReplicaReadiness
from promptcache.server.app import declares_body, is_open_path
from promptcache.server.errors import ServerError, response_for
from promptcache.server.generation import DONE, sse_error
from promptcache.server.settings import ServerSettings
from promptcache.server.tenants import Quota, TenantDirectory

logger = logging.getLogger(__name__)
REPLICA_LOST = (RayActorError, ActorUnavailableError, DeploymentUnavailableError)
HEALTH_PATH = "/health"


class Gateway:
    def __init__(self, replicas: DeploymentHandle, max_request_bytes: int = 2 << 20, max_attempts: int = 3,
                 settings: dict[str, Any] | None = None) -> None:
        """`settings`: the replicas' explicit ServerSettings fields; their API keys are checked here too, before a
        body is read (the replicas check them again)."""
        self.replicas = replicas.options(stream=True)
        self.max_request_bytes = max_request_bytes
        self.max_attempts = max_attempts
        self.readiness = ReplicaReadiness(replicas.app_name, replicas.deployment_name)
        resolved = ServerSettings(**(settings or {}))
        self.tenants = TenantDirectory.load(resolved.api_keys_file, resolved.api_keys, Quota())

    async def __call__(self, request: Request) -> Response:
        """Serve calls this for every HTTP request; the response it returns runs `relay`."""
        return _AsgiResponse(self.relay)

    async def relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the request, forward it to the replica the router picks (again, up to `max_attempts` times, while
        replicas die before answering), relay the answer."""
        request = ForwardedRequest.from_scope(scope, b"")
        try:
            self._check_before_body(request)
            request = replace(request, body=await self._read_body(receive))
        except (RequestTooLargeError, ServerError) as exc:
            await response_for(exc)(scope, receive, send)
            return
        if request.path == HEALTH_PATH and not (health := await self.readiness.health()).is_ready:
            await JSONResponse({"status": "not_ready", "deployment_status": health.status,
                                "replicas": health.replicas}, status_code=503)(scope, receive, send)
            return
        for attempt in range(1, self.max_attempts + 1):
            relayed = _Relayed()
            try:
                # options(stream=True): the call is a stream of the replica's ASGI messages
                messages = cast("AsyncIterator[Message]", self.replicas.forward.remote(request))
                async for message in messages:
                    relayed.note(message)
                    await send(message)
                return
            except REPLICA_LOST as exc:
                if relayed.is_started:
                    logger.warning("replica lost while answering %s %s: %s", request.method, request.path, exc)
                    await relayed.end_cut_short(send)
                    return
                logger.warning("replica lost before answering %s %s (attempt %d of %d): %s", request.method,
                               request.path, attempt, self.max_attempts, exc)
            except BackPressureError:
                error: ClusterError = ReplicasBusyError("every replica is busy; retry shortly", retry_after_s=1)
                break
        else:
            error = ReplicaLostError("no replica could serve the request; retry shortly", retry_after_s=1)
        await response_for(error, f"{request.method} {request.path}")(scope, receive, send)

    def _check_before_body(self, request: ForwardedRequest) -> None:
        """What the replicas' RequestGuard refuses before it reads a body, refused before this reads one: a missing or
        unknown API key (401), a body sent to a path that takes none (413). Rates are the replicas' to count."""
        if not is_open_path(request.path):
            self.tenants.authenticate(request.header("authorization"))
        elif declares_body(Headers(raw=list(request.headers))):
            raise RequestTooLargeError(f"{request.path} takes no request body")

    async def _read_body(self, receive: Receive) -> bytes:
        """The whole body, refusing more than the replicas' request limit (they check it again)."""
        body = bytearray()
        while (message := await receive())["type"] == "http.request":
            body += message.get("body", b"")
            if len(body) > self.max_request_bytes:
                raise RequestTooLargeError(f"request body exceeds the limit of {self.max_request_bytes} bytes")
            if not message.get("more_body", False):
                break
        return bytes(body)


class _Relayed:
    """What of a replica's response reached the client: whether it started, is an event stream, ended."""

    def __init__(self) -> None:
        self.is_started = self.is_event_stream = self.is_complete = False

    def note(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.is_started = True
            content_type = dict(message.get("headers", ())).get(b"content-type", b"")
            self.is_event_stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.is_complete = True

    async def end_cut_short(self, send: Send) -> None:
        """End a response whose replica died after it started: a stream gets an error event and [DONE]; any other
        body cannot say so in-band, so the connection is dropped (a truncated body is never ended as if whole)."""
        if self.is_complete:
            return
        if not self.is_event_stream:
            raise ReplicaLostError("the replica was lost mid-response")
        tail = sse_error(ReplicaLostError("the replica serving this stream stopped; the output is incomplete, "
                                          "retry the request")) + DONE
        await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})


class _AsgiResponse(Response):
    """A Starlette response that is an ASGI callable: Serve lets it send whatever it sends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)
