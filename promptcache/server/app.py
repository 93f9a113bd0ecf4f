"""The FastAPI app factory (the model loads in the background), the RequestGuard (API keys, rates, the body limit) and
the app's own routes: health, metrics (never behind the API key) and the web playground's files."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import logging
import os
import sys
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from promptcache import model_runtime
from promptcache.server import api_native, errors
from promptcache.server.openai import routes as openai_routes
from promptcache.server.service import PromptService
from promptcache.server.settings import ServerSettings
from promptcache.server.tenants import Quota, RequestRateLimiter, TenantDirectory

logger = logging.getLogger("promptcache.server")
GIL_SWITCH_INTERVAL_S = 0.001
METRICS_PATH = "/metrics"
OPEN_PATHS = frozenset({"/health", METRICS_PATH})
# The playground's page and assets hold no data (the page sends the user's key on its own calls); each goes out with a
# policy that lets it run only its own script and style, talk only to this server, and be framed by no other site.
PLAYGROUND_PATH = "/playground"
STATIC_DIR = resources.files("promptcache.server") / "playground"
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                    "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"}


def create_app(settings: ServerSettings | None = None, *,
               model_loader: Callable[[], model_runtime.LoadedModel] | None = None) -> FastAPI:
    """Build the app. The model loads in a worker thread after startup, so /health answers 503
    ("loading") at once and 200 when ready. `model_loader` replaces `load_model` (tests, embedding)."""
    settings = settings or ServerSettings()
    # A bad keys file fails here, before serving anything.
    tenants = TenantDirectory.load(settings.api_keys_file, settings.api_keys, Quota(
        max_schemas=settings.tenant_max_schemas, max_schema_tokens=settings.tenant_max_schema_tokens,
        rate_limit=settings.tenant_rate_limit, cache_share=settings.tenant_cache_share))
    load = model_loader or (lambda: model_runtime.load_model(settings.load_config()))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.service = app.state.load_error = None
        # The engine thread and parsing workers run Python between tensor ops; handing the GIL back
        # every millisecond (default 5) keeps the event loop answering (/health, streams) meanwhile.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # Torch's parallel work is the engine thread's alone (model_runtime/intraop_threads.py): this
        # thread and the workers behind asyncio.to_thread run their torch ops serially.
        model_runtime.confine_to_this_thread()
        asyncio.get_running_loop().set_default_executor(model_runtime.confined_executor())
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
    errors.install_error_handlers(app)
    app.add_middleware(RequestGuard, settings=settings, tenants=tenants, rates=app.state.rates)
    app.include_router(system)
    app.include_router(api_native.router)
    app.include_router(openai_routes.router)
    app.include_router(openai_routes.tokenizer_router)
    app.mount(PLAYGROUND_PATH + "/static", SecureStaticFiles(directory=str(STATIC_DIR)), name="playground")
    return app


async def _start(app: FastAPI, settings: ServerSettings, tenants: TenantDirectory,
                 load: Callable[[], model_runtime.LoadedModel]) -> None:
    try:
        # On threads that exit afterwards, with every core: no OpenMP team of theirs outlives the loading.
        loaded = await model_runtime.run_in_passing_thread(load)
        service = await model_runtime.run_in_passing_thread(PromptService, settings, loaded, tenants)
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
    logger.info("promptcache ready: model %s (%s, %s weights); attention %s (%s)", loaded.name,
                str(loaded.model.dtype).removeprefix("torch."), loaded.weights.value, service.attention.path.value,
                service.attention.reason)


system = APIRouter()


@system.get("/health")
async def health(request: Request) -> JSONResponse:
    if (service := getattr(request.app.state, "service", None)) is None:
        error = getattr(request.app.state, "load_error", None)
        return JSONResponse({"status": "failed", "error": error} if error else {"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok", "model": service.model_name, "weights": service.weights.value,
                         "attention": service.attention.as_dict()})


@system.get(METRICS_PATH)
async def metrics(request: Request) -> Response:
    service = getattr(request.app.state, "service", None)
    # Rendering reads tier sizes (a Redis call): off the event loop, never waiting on the engine.
    body = await asyncio.to_thread(service.metrics.render) if service is not None else b""
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@system.get(PLAYGROUND_PATH, include_in_schema=False)
async def playground_redirect() -> RedirectResponse:
    return RedirectResponse(PLAYGROUND_PATH + "/", headers=SECURITY_HEADERS)


@system.get(PLAYGROUND_PATH + "/", include_in_schema=False)
async def playground_index() -> FileResponse:
    return FileResponse(str(STATIC_DIR / "index.html"), media_type="text/html", headers=SECURITY_HEADERS)


def is_open_path(path: str) -> bool:
    """Whether `path` is served without an API key (health, metrics, the playground): it takes no request body."""
    return path in OPEN_PATHS or path.startswith(PLAYGROUND_PATH)


def declares_body(headers: Headers) -> bool:
    """Whether the request says it sends a body (a positive Content-Length, or a chunked one)."""
    length = headers.get("content-length", "")
    return (length != "" and length != "0") or "transfer-encoding" in headers


class SecureStaticFiles(StaticFiles):
    """The page's scripts and styles (mounted under /playground/static), with SECURITY_HEADERS."""

    def file_response(self, full_path: str | os.PathLike[str], stat_result: os.stat_result, scope: Scope,
                      status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(SECURITY_HEADERS)
        return response


class RequestGuard:
    """API keys (-> the caller's tenant, in `request.state.tenant`), request rates and the body limit, as plain
    ASGI before any route runs. The limit counts the bytes received (chunked or not; Content-Length is only an
    early rejection), buffers at most the limit in one buffer and answers 413 once it is crossed; the body is
    replayed as one message. The open paths (health, metrics, the playground) take no body: one is a 413 before
    any of it is read."""

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
        path = scope["path"]
        pending: list[Message] = []
        try:
            if is_open_path(path):  # answered to anyone without a key: a body is refused unread, never buffered
                if declares_body(headers):
                    raise errors.PayloadTooLargeError(f"{path} takes no request body")
                if path == METRICS_PATH:
                    self._check_metrics_key(headers)
            else:
                tenant = self.tenants.authenticate(headers.get("authorization", ""))
                self.rates.check(tenant)
                scope.setdefault("state", {})["tenant"] = tenant
                length = headers.get("content-length", "")
                if length.isdigit() and int(length) > self.max_bytes:
                    raise errors.PayloadTooLargeError(f"request body is {length} bytes; the limit is "
                                                      f"{self.max_bytes}")
                pending.append(await self._read_body(receive))
        except errors.ServerError as exc:
            await errors.response_for(exc)(scope, receive, send)
            return

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> Message:
        """The request's body as one message, counted as it arrives; stops at the limit (or the disconnect that cut
        it short, which the app then sees). One buffer: kept per message, a body trickled a byte at a time held a
        message object per byte, ~190 times its size."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                raise errors.PayloadTooLargeError(f"request body exceeds the limit of {self.max_bytes} bytes")
            if not message.get("more_body", False):
                return {"type": "http.request", "body": bytes(body), "more_body": False}

    def _check_metrics_key(self, headers: Headers) -> None:
        """/metrics needs the metrics key when one is set (it is never behind the tenants' keys). Without one it
        is open, unless a keys file names tenants: its series name every tenant, so it is then closed."""
        if self.metrics_digest is None:
            if self.is_metrics_closed:
                raise errors.UnauthorizedError("/metrics names every tenant, so with an API keys file it needs a "
                                               "metrics key and this server has none (set PROMPTCACHE_METRICS_KEY)")
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if not (hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.metrics_digest)
                and scheme.lower() == "bearer"):
            raise errors.UnauthorizedError("/metrics needs the metrics key (send Authorization: Bearer <metrics key>)")
