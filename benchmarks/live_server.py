"""A `promptcache serve` subprocess for benchmarks that measure over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_promptcache(flags: list[str], *, ready_timeout_s: float = 300,
                      env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start the server (default model unless `flags` name one) on a free loopback port, with extra
    environment `env`; wait for /health 200. Returns the process and its base URL."""
    port = free_port()
    command = [sys.executable, "-m", "promptcache.cli", "serve", "--port", str(port), "--no-examples",
               "--log-level", "warning", *flags]
    process = subprocess.Popen(command, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"promptcache exited with {process.returncode}")
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"promptcache did not become ready in {ready_timeout_s:.0f} s")


@contextmanager
def promptcache_server(flags: list[str]):
    """`with promptcache_server([...]) as url:` — the server is stopped on exit."""
    process, url = start_promptcache(flags)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
