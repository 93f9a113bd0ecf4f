"""Access to the app's PromptService (503 while the model loads) and the caller's tenant from routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from promptcache.server.errors import NotReadyError
from promptcache.server.service import PromptService


def get_service(request: Request) -> PromptService:
    service = getattr(request.app.state, "service", None)
    if service is None:
        error = getattr(request.app.state, "load_error", None)
        raise NotReadyError(f"model failed to load: {error}" if error else "the model is still loading")
    return service


Service = Annotated[PromptService, Depends(get_service)]


def get_tenant(request: Request) -> str | None:
    """The caller's tenant, set by the RequestGuard from its API key (None: the default tenant)."""
    return request.state.tenant if "tenant" in request.scope.get("state", {}) else None


Tenant = Annotated[str | None, Depends(get_tenant)]
