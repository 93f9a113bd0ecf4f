"""A tenant's full waiting queue over HTTP: 429 with Retry-After for that tenant only, on every route that
queues work, and room again once a waiting request leaves."""

from __future__ import annotations

import json
import time

import httpx

KEYS = {"keys": {"sk-a": "alpha", "sk-b": "beta"}}
LONG = {"model": "m", "prompt": "Once upon a time", "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
        "stream": True}
SHORT = {"model": "m", "prompt": "The sea was calm", "max_tokens": 2, "temperature": 0}


def _client(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _status(client: httpx.Client, body: dict) -> int:
    """The status of a streamed completion, read from its headers (the stream is closed unread)."""
    with client.stream("POST", "/v1/completions", json=body) as reply:
        return reply.status_code


def test_a_full_tenant_queue_is_429_with_retry_after(live_server, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    server = live_server(api_keys_file=str(keys_file), max_num_seqs=1, max_waiting_per_tenant=2)
    alpha, beta = _client(server, "sk-a"), _client(server, "sk-b")
    stream = {**SHORT, "stream": True}
    with alpha.stream("POST", "/v1/completions", json=LONG) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # held: a dropped iterator closes the stream, which aborts the request
        next(lines)  # its first token: it holds the only sequence slot
        with alpha.stream("POST", "/v1/completions", json=stream) as first, \
                alpha.stream("POST", "/v1/completions", json=stream) as second:
            assert first.status_code == second.status_code == 200  # both wait: alpha's queue is full
            for body in (SHORT, stream, {**SHORT, "prompt": ["a", "b"]}):
                refused = alpha.post("/v1/completions", json=body)
                assert refused.status_code == 429, refused.text
                assert int(refused.headers["retry-after"]) >= 1
                error = refused.json()["error"]
                assert error["type"] == "queue_full" and "2 requests waiting" in error["message"]
            refused = alpha.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2,
                                                                "messages": [{"role": "user", "content": "Hi"}]})
            assert refused.status_code == 429 and "retry-after" in refused.headers, refused.text
            too_many = beta.post("/v1/completions", json={**SHORT, "prompt": ["a", "b", "c"]})
            assert too_many.status_code == 400 and "at most 2" in too_many.json()["error"]["message"]
            with beta.stream("POST", "/v1/completions", json=stream) as other:
                assert other.status_code == 200  # beta's queue is its own
        # Closing the waiting streams aborts their requests (the server notices, the engine drops them):
        # alpha has room again within moments, as a client honouring Retry-After finds.
        deadline = time.monotonic() + 30
        while (status := _status(alpha, stream)) == 429 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200
