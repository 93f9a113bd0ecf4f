"""Server subprocesses for benchmarks: `promptcache serve`, llama.cpp's `llama-server`, a throwaway redis-server."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import redis


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


class RedisServer:
    """A redis-server on a free loopback port without persistence. `kill` then `start` restarts it empty
    on the same port (an outage as a client sees it)."""

    def __init__(self, directory: str) -> None:
        self.port = free_port()
        self.directory = directory
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *, ready_timeout_s: float = 5.0) -> None:
        """Start the process and wait until it answers PING. Raises RuntimeError if it does not."""
        self.process = subprocess.Popen([shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no", "--dir", self.directory],
                                        stdout=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            try:
                client.ping()
                return
            except redis.RedisError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@contextmanager
def promptcache_server(flags: list[str]):
    """`with promptcache_server([...]) as url:` — the server is stopped on exit."""
    process, url = start_promptcache(flags)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@dataclass
class Streamed:
    """One streamed completion as the client saw it."""

    ttft_ms: float
    text: str
    headers: dict[str, str]
    chunks: list[dict] = field(default_factory=list)  # every parsed event, in order

    @property
    def final(self) -> dict:
        """The last event carrying usage (with promptcache's cache report), or {}."""
        return next((c for c in reversed(self.chunks) if c.get("usage")), {})


def stream_completion(client: httpx.Client, url: str, body: dict) -> Streamed:
    """POST `body` with stream=True (and streamed usage on the OpenAI routes) and read the server-sent
    events; TTFT is from sending to the first text or finish (this client's clock). Raises RuntimeError
    on an HTTP error or an error event."""
    body = {**body, "stream": True}
    if not url.endswith("/v1/generate"):
        body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    first, text, chunks = None, "", []
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.read()[:300]!r}")
        headers = dict(response.headers)
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            chunks.append(chunk)
            for choice in chunk.get("choices") or []:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if first is None and (piece or choice.get("finish_reason")):
                    first = time.perf_counter()
                text += piece
    return Streamed(((first or time.perf_counter()) - started) * 1e3, text, headers, chunks)


def start_llama_server(binary: str, model_path: str, *, num_slots: int, ctx_per_slot: int = 2560,
                       threads: int = 2, ready_timeout_s: float = 300,
                       extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """Start llama.cpp's `llama-server` on a free loopback port: `num_slots` parallel slots of
    `ctx_per_slot` tokens each (`--no-kv-unified`, llama-server's default when `-np` is given), prompt
    reuse by KV shifting (`--cache-reuse 64`); wait for /health 200. Returns the process and its base URL."""
    port = free_port()
    command = [binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-np", str(num_slots), "-c", str(num_slots * ctx_per_slot), "--no-kv-unified", "--cache-reuse", "64",
               "--log-disable", *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}: {' '.join(command)}")
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"llama-server did not become ready in {ready_timeout_s:.0f} s")
