"""PromptCacheReplica: one Ray Serve replica running `promptcache.server.create_app(settings)` unchanged, with
its model and engine, plus ReplicaHeader. The gateway calls `forward` with the whole request; the replica
replays it into the app and streams the ASGI messages back."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from promptcache.cluster.errors import ReplicaStartError
from promptcache.cluster.forwarded import ForwardedRequest

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)
REPLICA_HEADER = b"x-promptcache-replica"
READY_TIMEOUT_S = 600.0
READY_POLL_S = 0.02
UNGATED_PATHS = frozenset({"/health", "/metrics"})  # answered while the engine starts (503 "loading")


class ReplicaHeader:
    """ASGI middleware: adds `x-promptcache-replica: <replica id>` to every response."""

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self.value = replica_id.encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.value)]}
            await send(message)

        await self.app(scope, receive, named)


@serve.ingress()
class PromptCacheReplica:
    # An async constructor: Serve awaits it (mypy knows only synchronous ones).
    async def __init__(self, settings: dict[str, Any], num_threads: int = 1) -> None:  # type: ignore[misc]
        """`settings`: ServerSettings fields given explicitly (the rest come from PROMPTCACHE_* variables
        of the replica's environment, as for `promptcache serve`)."""
        import torch

        from promptcache.model_runtime import load_model, run_in_passing_thread
        from promptcache.server.settings import ServerSettings

        torch.set_num_threads(max(1, num_threads))
        self.settings = ServerSettings(**settings)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # a thread that exits afterwards: its OpenMP team does not outlive loading (model_runtime/intraop_threads.py)
        self.loaded = await run_in_passing_thread(load_model, self.settings.load_config())
        self.fastapi: FastAPI | None = None  # built by Serve right after the constructor

    def __serve_build_asgi_app__(self) -> FastAPI:
        from promptcache.server import create_app

        app = create_app(self.settings, model_loader=lambda: self.loaded)
        app.add_middleware(ReplicaHeader, replica_id=self.replica_id)  # outermost: 401s are named too
        self.fastapi = app
        return app

    async def check_health(self) -> None:
        """Ray's health check. The first one runs before the replica is routable: it waits until the app's
        engine has started, so the replica takes requests (and counts as running) only then. A replica
        whose engine failed to start, or did not start in READY_TIMEOUT_S, is replaced."""
        if self.fastapi is None:
            return
        if not await self._wait_ready():
            raise ReplicaStartError(f"replica {self.replica_id} did not start within {READY_TIMEOUT_S:.0f} s")
        if error := getattr(self.fastapi.state, "load_error", None):
            raise ReplicaStartError(f"replica {self.replica_id} failed to start: {error}")

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[Message]:
        """Serve `request` with the app; yields its ASGI response messages as they are sent."""
        if request.path not in UNGATED_PATHS:
            await self._wait_ready()
        messages: asyncio.Queue[Message | None] = asyncio.Queue()
        body: list[Message] = [{"type": "http.request", "body": request.body, "more_body": False}]

        async def receive() -> Message:
            if body:
                return body.pop()
            return await asyncio.Future()  # never: a client disconnect reaches us as a cancellation instead

        async def run() -> None:
            try:
                assert self.fastapi is not None, "Serve builds the app before any request"
                await self.fastapi(request.asgi_scope(), receive, messages.put)  # unbounded: never waits
            except Exception:  # Starlette has answered 500 already and re-raises; it is in the log
                logger.exception("%s %s failed on replica %s", request.method, request.path, self.replica_id)
            finally:
                messages.put_nowait(None)

        task = asyncio.create_task(run())
        try:
            while (message := await messages.get()) is not None:
                yield message
        finally:
            task.cancel()  # no-op once it is done

    async def _wait_ready(self) -> bool:
        """Wait until the app's service started or failed to; False if neither happened in time."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        assert self.fastapi is not None, "Serve builds the app before any request"
        state = self.fastapi.state
        while time.monotonic() < deadline:
            if getattr(state, "service", None) is not None or getattr(state, "load_error", None):
                return True
            await asyncio.sleep(READY_POLL_S)
        return False
