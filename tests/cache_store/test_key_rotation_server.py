"""Blob-key rotation and `promptcache encode` end to end: real servers over HTTP on one real Redis."""

from __future__ import annotations

import httpx
import pytest

from promptcache.cli import main
from tests.model_factories import make_tiny_loaded
from tests.server.conftest import LiveServer, settings_for

OLD, NEW = "o" * 32, "n" * 32
SCHEMA = """<schema name="docs"><system>Answer from the documents.</system>
  <user><module name="d1">Cats sleep most of the day.</module><module name="d2">Tea is brewed hot.</module></user>
</schema>"""
DOCUMENT = "The quick brown fox jumps over the lazy dog. Rome was not built in a day. " * 3
PROMPT = f'<prompt schema="docs"><user><d1/><d2/>{DOCUMENT}Who sleeps?</user><assistant/></prompt>'
EXAMPLES = {"library", "trip-planner"}


@pytest.fixture
def start(redis_server):
    servers: list[LiveServer] = []

    def start(**overrides) -> LiveServer:
        settings = settings_for(redis_url=redis_server.url, namespace="rot", prefix_block_size=8, **overrides)
        servers.append(LiveServer(settings, lambda: make_tiny_loaded("llama")).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _explain(server: LiveServer) -> dict:
    response = httpx.post(server.url + "/v1/prompts/explain", json={"prompt": PROMPT}, timeout=60)
    response.raise_for_status()
    return response.json()


def _generate(server: LiveServer) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    response = httpx.post(server.url + "/v1/generate", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def _flush_and_stop(server: LiveServer) -> None:
    assert server.app.state.service.store.flush(timeout_s=30)
    server.stop()


@pytest.mark.timeout(300)
def test_server_after_key_rotation_becomes_ready_and_serves_from_redis_after_one_rewrite(start):
    old = start(blob_key=OLD, preload_examples=True)
    httpx.post(old.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    _generate(old)
    assert _explain(old)["prefix"]["num_tokens"] > 0  # the prompt's blocks are stored (and written to Redis)
    _flush_and_stop(old)

    new = start(blob_key=NEW, preload_examples=True)  # ready: the examples sealed under OLD did not block preload
    listed = {s["name"] for s in httpx.get(new.url + "/v1/schemas", timeout=30).json()["data"]}
    assert listed == EXAMPLES  # "docs", sealed under OLD, is not listed ...
    assert httpx.get(new.url + "/v1/schemas/docs", timeout=30).status_code == 404  # ... reads as not found ...
    assert httpx.post(new.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).status_code == 201  # ... no 409
    assert _explain(new)["prefix"] is None  # the prefix blocks sealed under OLD count for nothing
    first = _generate(new)  # the one rewrite
    assert first["cache"]["prefix"] is None
    _flush_and_stop(new)

    replica = start(blob_key=NEW)
    explained = _explain(replica)  # adopts "docs" from the registry
    assert {m["tier"] for m in explained["modules"]} == {"redis"}
    assert explained["prefix"]["tiers"].get("redis", 0) > 0
    again = _generate(replica)
    assert again["choices"] == first["choices"] and again["cache"]["prefix"]["tiers"].get("redis", 0) > 0


@pytest.mark.timeout(300)
def test_encode_cli_signs_what_it_writes_so_a_keyed_server_serves_it(start, redis_server, tmp_path, monkeypatch):
    monkeypatch.setattr("promptcache.model_runtime.load_model", lambda config: make_tiny_loaded("llama"))
    monkeypatch.setenv("PROMPTCACHE_BLOB_KEY", NEW)
    monkeypatch.setenv("PROMPTCACHE_NAMESPACE", "rot")
    schema = tmp_path / "docs.pml"
    schema.write_text(SCHEMA)
    assert main(["encode", "--redis-url", redis_server.url, str(schema)]) == 0

    server = start(blob_key=NEW)
    uploaded = httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60)
    assert uploaded.status_code == 201
    # Every module was found in Redis (signed with the server's key), so the upload encoded none of them.
    assert {m["tier"] for m in _explain(server)["modules"]} == {"redis"}
