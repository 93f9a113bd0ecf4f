"""HTTP server: FastAPI app factory, native PML API, OpenAI-compatible API, metrics. Never touches a tensor."""

from promptcache.server.app import create_app
from promptcache.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
