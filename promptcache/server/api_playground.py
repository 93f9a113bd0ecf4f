"""The web playground: static files served at /playground (no data in them, so no API key needed to load
them; every API call the page makes carries the key the user types).

Every file goes out with a Content-Security-Policy that lets the page run only its own script and style and
talk only to this server, which no other site may frame (the page holds the user's keys), and nosniff."""

from __future__ import annotations

import os
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

PLAYGROUND_PATH = "/playground"
STATIC_DIR = resources.files("promptcache.server") / "playground"
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                    "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"}

router = APIRouter()


@router.get(PLAYGROUND_PATH, include_in_schema=False)
async def playground_redirect() -> RedirectResponse:
    return RedirectResponse(PLAYGROUND_PATH + "/", headers=SECURITY_HEADERS)


@router.get(PLAYGROUND_PATH + "/", include_in_schema=False)
async def playground_index() -> FileResponse:
    return FileResponse(str(STATIC_DIR / "index.html"), media_type="text/html", headers=SECURITY_HEADERS)


class SecureStaticFiles(StaticFiles):
    """The page's scripts and styles (mounted under /playground/static), with SECURITY_HEADERS."""

    def file_response(self, full_path: str | os.PathLike[str], stat_result: os.stat_result, scope: Scope,
                      status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(SECURITY_HEADERS)
        return response
