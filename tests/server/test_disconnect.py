"""A non-streaming request whose client goes away is aborted in the engine: the server stops computing tokens no
one will read (a real server, a real socket closed mid-generation)."""

from __future__ import annotations

import gc
import json
import logging
import socket
import threading
import time

import pytest

from tests.model_factories import make_tiny_loaded
from tests.server.test_api import PROMPT, SCHEMA

MAX_TOKENS = 1500
STEP_S = 0.01  # each forward pass takes at least this long: a whole generation takes MAX_TOKENS x 10 ms


class SlowModel:
    """The tiny model, slowed down to STEP_S a forward pass, counting its passes."""

    def __init__(self) -> None:
        self.num_forwards = 0
        self.lock = threading.Lock()

    def load(self):
        loaded = make_tiny_loaded("llama")

        def slow(module, args, output):
            time.sleep(STEP_S)
            with self.lock:
                self.num_forwards += 1

        loaded.model.get_output_embeddings().register_forward_hook(slow)
        return loaded


def send(port: int, path: str, payload: dict) -> socket.socket:
    """A POST written to a fresh connection; the response is never read."""
    body = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize(("path", "payload"), [
    ("/v1/completions", {"prompt": "a", "max_tokens": MAX_TOKENS, "ignore_eos": True}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": MAX_TOKENS, "ignore_eos": True}),  # several prompts
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": MAX_TOKENS,
                              "ignore_eos": True}),
    ("/v1/generate", {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}),
])
def test_a_request_whose_client_disconnects_is_aborted_in_the_engine(live_server, path, payload, caplog):
    model = SlowModel()
    server = live_server(loader=model.load, logits_cache_bytes=0)
    if path == "/v1/generate":
        import httpx

        assert httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).status_code == 201
    runtime = server.app.state.service.runtime
    sock = send(server.settings.port, path, payload)
    assert wait_for(lambda: runtime.stats().num_running > 0 and model.num_forwards > 5, 30), "never started"
    sock.close()
    # Aborted within a step or two, not after the MAX_TOKENS x 10 ms (15 s) the generation would take.
    assert wait_for(lambda: runtime.stats().num_running == 0 and runtime.stats().num_waiting == 0, 5), \
        f"still generating after the client left ({model.num_forwards} forward passes)"
    stopped_at = model.num_forwards
    time.sleep(0.3)
    assert model.num_forwards == stopped_at < MAX_TOKENS / 3
    gc.collect()  # a future whose exception nobody read is reported when it is collected
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
