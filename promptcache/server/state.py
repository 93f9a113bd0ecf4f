"""Access to the app's PromptService (503 while the model loads), the caller's tenant and the tenants'
rate limiter from routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from promptcache.server.errors import NotReadyError
from promptcache.server.service import PromptService
from promptcache.server.tenants import RequestRateLimiter


def get_service(request: Request) -> PromptService:
    service = getattr(request.app.state, "service", None)
    if service is None:
        error = getattr(request.app.state, "load_error", None)
        raise NotReadyError(f"the model failed to load: {error}" if error else "the model is still loading")
    return service


Service = Annotated[PromptService, Depends(get_service)]


def get_tenant(request: Request) -> str | None:
    """The caller's tenant, set by the RequestGuard from its API key (None: the default tenant)."""
    return request.state.tenant if "tenant" in request.scope.get("state", {}) else None


Tenant = Annotated[str | None, Depends(get_tenant)]


def get_rates(request: Request) -> RequestRateLimiter:
    """The rate limiter the RequestGuard counts with: a generating route counts its samples past the one hit
    the guard counted (`rates.check(tenant, cost, already_counted=1)`)."""
    return request.app.state.rates


Rates = Annotated[RequestRateLimiter, Depends(get_rates)]
