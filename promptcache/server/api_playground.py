"""The web playground: static files served at /playground (no data in them, so no API key needed to load
them; every API call the page makes carries the key the user types)."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

PLAYGROUND_PATH = "/playground"
STATIC_DIR = resources.files("promptcache.server") / "playground"

router = APIRouter()


@router.get(PLAYGROUND_PATH, include_in_schema=False)
async def playground_redirect() -> RedirectResponse:
    return RedirectResponse(PLAYGROUND_PATH + "/")


@router.get(PLAYGROUND_PATH + "/", include_in_schema=False)
async def playground_index() -> FileResponse:
    return FileResponse(str(STATIC_DIR / "index.html"), media_type="text/html")


def static_files() -> StaticFiles:
    """The page's scripts and styles, mounted under /playground/static."""
    return StaticFiles(directory=str(STATIC_DIR))
