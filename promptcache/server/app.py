"""The FastAPI app factory: lifespan (load model in the background, start the engine), auth, limits; and the
app's own routes, health and metrics (never behind the API key)."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from promptcache.model_runtime import (
    LoadedModel,
    confine_to_this_thread,
    confined_executor,
    load_model,
    run_in_passing_thread,
)
from promptcache.server import api_native, api_playground
from promptcache.server.errors import install_error_handlers
from promptcache.server.guard import RequestGuard
from promptcache.server.openai import routes as openai_routes
from promptcache.server.service import PromptService
from promptcache.server.settings import ServerSettings
from promptcache.server.tenants import Quota, RequestRateLimiter, TenantDirectory

logger = logging.getLogger("promptcache.server")
GIL_SWITCH_INTERVAL_S = 0.001


def create_app(settings: ServerSettings | None = None, *,
               model_loader: Callable[[], LoadedModel] | None = None) -> FastAPI:
    """Build the app. The model loads in a worker thread after startup, so /health answers 503
    ("loading") at once and 200 when ready. `model_loader` replaces `load_model` (tests, embedding)."""
    settings = settings or ServerSettings()
    # A bad keys file fails here, before serving anything.
    tenants = TenantDirectory.load(settings.api_keys_file, settings.api_keys, Quota(
        max_schemas=settings.tenant_max_schemas, max_schema_tokens=settings.tenant_max_schema_tokens,
        rate_limit=settings.tenant_rate_limit, cache_share=settings.tenant_cache_share))

    load = model_loader or (lambda: load_model(settings.load_config()))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.service = None
        app.state.load_error = None
        # The engine thread and parsing workers run Python between tensor ops; handing the GIL back
        # every millisecond (default 5) keeps the event loop answering (/health, streams) meanwhile.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # Torch's parallel work is the engine thread's alone (model_runtime/intraop_threads.py): this
        # thread and the workers behind asyncio.to_thread run their torch ops serially.
        confine_to_this_thread()
        asyncio.get_running_loop().set_default_executor(confined_executor())
        task = asyncio.create_task(_start(app, settings, tenants, load))
        try:
            yield
        finally:
            task.cancel()
            if app.state.service is not None:
                app.state.service.close()

    app = FastAPI(title="promptcache", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.rates = RequestRateLimiter(tenants)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, settings=settings, tenants=tenants, rates=app.state.rates)
    app.include_router(system)
    app.include_router(api_native.router)
    app.include_router(openai_routes.router)
    app.include_router(openai_routes.tokenizer_router)
    app.include_router(api_playground.router)
    app.mount(api_playground.PLAYGROUND_PATH + "/static",
              api_playground.SecureStaticFiles(directory=str(api_playground.STATIC_DIR)), name="playground")
    return app


async def _start(app: FastAPI, settings: ServerSettings, tenants: TenantDirectory,
                 load: Callable[[], LoadedModel]) -> None:
    try:
        # On threads that exit afterwards, with every core: no OpenMP team of theirs outlives the loading.
        loaded = await run_in_passing_thread(load)
        service = await run_in_passing_thread(PromptService, settings, loaded, tenants)
        await service.start()
        # Everything alive now (the model, tokenizer, libraries: ~470K objects) lives as long as the
        # process: out of the collector's sight, a full collection no longer walks it. Walked, it held the
        # GIL for 100-240 ms at a time, in the middle of streams (inter-token and TTFT tails).
        gc.collect()
        gc.freeze()
    except Exception:  # logged; /health and 503s name only the error id (no paths or addresses)
        error_id = uuid.uuid4().hex[:12]
        logger.exception("startup failed (error id %s)", error_id)
        app.state.load_error = f"startup failed (id {error_id}; the server log says why)"
        return
    app.state.service = service
    logger.info("promptcache ready: model %s; attention %s (%s)", loaded.name, service.attention.path.value,
                service.attention.reason)


system = APIRouter()


@system.get("/health")
async def health(request: Request) -> JSONResponse:
    service = getattr(request.app.state, "service", None)
    if service is None:
        error = getattr(request.app.state, "load_error", None)
        body = {"status": "failed", "error": error} if error else {"status": "loading"}
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok", "model": service.model_name, "attention": service.attention.as_dict()})


@system.get("/metrics")
async def metrics(request: Request) -> Response:
    service = getattr(request.app.state, "service", None)
    # Rendering reads tier sizes (a Redis call): off the event loop, never waiting on the engine.
    body = await asyncio.to_thread(service.metrics.render) if service is not None else b""
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
