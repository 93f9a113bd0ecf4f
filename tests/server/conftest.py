"""A real uvicorn server on loopback, in a thread, over a tiny model (and a real Redis when asked)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn

from promptcache.server import ServerSettings, create_app
from tests.model_factories import make_tiny_loaded
from tests.redis_server import free_port


class LiveServer:
    def __init__(self, settings: ServerSettings, loader) -> None:
        self.settings = settings
        self.app = create_app(settings, model_loader=loader)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=settings.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def start(self, *, ready: bool = True) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 180  # loading + preloading examples on a busy 2-core machine
        while time.monotonic() < deadline:
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
                if status == 200 or (not ready and status == 503):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def settings_for(**overrides) -> ServerSettings:
    # fidelity=fast, context schema: the suite exercises module reuse as encoded unless a test names a mode
    base = dict(port=free_port(), preload_examples=False, max_num_seqs=16, max_kv_bytes=64 << 20,
                fidelity="fast", fidelity_context="schema")
    return ServerSettings(**{**base, **overrides})


@pytest.fixture
def live_server():
    servers = []

    def start(loader=None, ready: bool = True, **overrides) -> LiveServer:
        server = LiveServer(settings_for(**overrides), loader or (lambda: make_tiny_loaded("llama")))
        servers.append(server)
        return server.start(ready=ready)

    yield start
    for server in servers:
        server.stop()
