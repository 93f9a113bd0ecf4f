"""Health and metrics (never behind the API key)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    service = getattr(request.app.state, "service", None)
    if service is None:
        error = getattr(request.app.state, "load_error", None)
        body = {"status": "failed", "error": error} if error else {"status": "loading"}
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok", "model": service.model_name, "attention": service.attention.as_dict()})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    service = getattr(request.app.state, "service", None)
    # Rendering reads tier sizes (a Redis call): off the event loop, never waiting on the engine.
    body = await asyncio.to_thread(service.metrics.render) if service is not None else b""
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
