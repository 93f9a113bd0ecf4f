"""The FastAPI app factory: lifespan (load model in the background, start the engine), auth, limits."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.middleware.base import BaseHTTPMiddleware

from promptcache.model_runtime import LoadedModel, ModelConfig, load_model
from promptcache.server import api_native, api_openai, api_system
from promptcache.server.errors import (
    PayloadTooLargeError,
    UnauthorizedError,
    error_response,
    install_error_handlers,
    status_for,
)
from promptcache.server.service import PromptService
from promptcache.server.settings import ServerSettings

logger = logging.getLogger("promptcache.server")
OPEN_PATHS = {"/health", "/metrics"}


def create_app(settings: ServerSettings | None = None, *,
               model_loader: Callable[[], LoadedModel] | None = None) -> FastAPI:
    """Build the app. The model loads in a worker thread after startup, so /health answers 503
    ("loading") at once and 200 when ready. `model_loader` replaces `load_model` (tests, embedding)."""
    settings = settings or ServerSettings()

    def load() -> LoadedModel:
        if model_loader is not None:
            return model_loader()
        return load_model(ModelConfig(settings.model, dtype=settings.dtype, device=settings.device,
                                      cache_dir=settings.model_cache_dir))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.service = None
        app.state.load_error = None
        task = asyncio.create_task(_start(app, settings, load))
        try:
            yield
        finally:
            task.cancel()
            if app.state.service is not None:
                app.state.service.close()

    app = FastAPI(title="promptcache", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(_Guard, settings=settings)
    app.include_router(api_system.router)
    app.include_router(api_native.router)
    app.include_router(api_openai.router)
    return app


async def _start(app: FastAPI, settings: ServerSettings, load: Callable[[], LoadedModel]) -> None:
    try:
        loaded = await asyncio.to_thread(load)
        service = await asyncio.to_thread(PromptService, settings, loaded)
        await service.start()
    except Exception as exc:  # surfaced by /health and 503s, and logged
        logger.exception("startup failed")
        app.state.load_error = f"{type(exc).__name__}: {exc}"
        return
    app.state.service = service
    logger.info("promptcache ready: model %s", loaded.name)


class _Guard(BaseHTTPMiddleware):
    """API keys (constant-time compare) and request-size limits, before any route runs."""

    def __init__(self, app, settings: ServerSettings) -> None:
        super().__init__(app)
        self.settings = settings
        self.keys = [k.encode() for k in settings.api_keys]

    async def dispatch(self, request: Request, call_next):
        try:
            if request.url.path not in OPEN_PATHS:
                self._authenticate(request)
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.settings.max_request_bytes:
                raise PayloadTooLargeError(f"request body is {length} bytes; the limit is "
                                           f"{self.settings.max_request_bytes}")
        except (UnauthorizedError, PayloadTooLargeError) as exc:
            status, kind = status_for(exc)
            response = error_response(status, kind, str(exc))
            if status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await call_next(request)

    def _authenticate(self, request: Request) -> None:
        if not self.keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), k) for k in self.keys):
            raise UnauthorizedError("missing or invalid API key (send Authorization: Bearer <key>)")
