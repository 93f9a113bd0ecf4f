"""What error bodies and SSE error events may say, against the real server: 4xx say what is wrong; 5xx (500s
and 503s alike) name an error id and never internals (Redis host:port, paths, exception text), which the
server log has under that id. Plus /metrics closed to anyone without the metrics key once tenants exist."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest

from tests.server.test_api import PROMPT, SCHEMA

SECRET = "/srv/secret/weights.bin"


def _error_id(message: str) -> str:
    found = re.search(r"\(id ([0-9a-f]{12})", message)
    assert found, message
    return found.group(1)


def _logged(caplog, error_id: str) -> str:
    """Everything the server logged under `error_id`, traceback included."""
    return "\n".join(f"{r.getMessage()}\n{r.exc_text or ''}" for r in caplog.records if error_id in r.getMessage())


def test_a_503_from_redis_names_an_error_id_not_the_redis_address(live_server, redis_server, caplog):
    server = live_server(redis_url=redis_server.url, tenant_max_schemas=5)
    assert httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).status_code == 201
    redis_server.stop()
    caplog.set_level(logging.ERROR, logger="promptcache.server")
    for response in (httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA.replace('"docs"', '"more"')},
                                timeout=60),
                     httpx.delete(server.url + "/v1/schemas/docs", timeout=60)):
        assert response.status_code == 503 and response.json()["error"]["type"] == "cache_unavailable"
        message = response.json()["error"]["message"]
        assert str(redis_server.port) not in message and "127.0.0.1" not in message, message
        assert str(redis_server.port) in _logged(caplog, _error_id(message))  # the operator still sees why


def test_a_500_in_a_stream_or_a_body_carries_an_error_id_only(live_server, caplog, monkeypatch):
    server = live_server()
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    service = server.app.state.service

    def broken_detokenize(token_ids):
        raise OSError(f"cannot read {SECRET}")

    monkeypatch.setattr(service.runtime, "detokenize", broken_detokenize)
    caplog.set_level(logging.ERROR, logger="promptcache.server")
    body = {"prompt": PROMPT, "max_tokens": 3, "return_spans": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/generate", json={**body, "stream": True}, timeout=60) as stream:
        assert stream.status_code == 200
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["status"] == 500 and SECRET not in error["message"]
    assert SECRET in _logged(caplog, _error_id(error["message"]))
    plain = httpx.post(server.url + "/v1/generate", json=body, timeout=60)
    assert plain.status_code == 500 and SECRET not in plain.text
    assert SECRET in _logged(caplog, _error_id(plain.json()["error"]["message"]))
    # A 4xx keeps its helpful message.
    unknown = httpx.post(server.url + "/v1/generate", json={"prompt": PROMPT.replace("docs", "nope")})
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]


def test_a_failed_start_is_reported_by_error_id(live_server, caplog):
    def broken_loader():
        raise OSError(f"cannot read {SECRET}")

    caplog.set_level(logging.ERROR, logger="promptcache.server")
    server = live_server(loader=broken_loader, ready=False)
    health = httpx.get(server.url + "/health")
    for _ in range(100):
        if health.json()["status"] == "failed":
            break
        health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    refused = httpx.get(server.url + "/v1/schemas")
    for response in (health, refused):
        assert SECRET not in response.text
    assert refused.status_code == 503 and "failed to load" in refused.json()["error"]["message"]
    assert SECRET in _logged(caplog, _error_id(health.json()["error"]))


@pytest.mark.parametrize("metrics_key", [None, "metrics-secret"])
def test_metrics_need_the_metrics_key_whenever_a_keys_file_is_set(live_server, tmp_path, metrics_key):
    keys = tmp_path / "keys.json"
    keys.write_text('{"sk-a": "alpha"}')
    server = live_server(api_keys_file=str(keys), metrics_key=metrics_key)
    tenant_key = {"Authorization": "Bearer sk-a"}
    for headers in (None, tenant_key):  # neither nobody nor a tenant reads every tenant's counts
        closed = httpx.get(server.url + "/metrics", headers=headers)
        assert closed.status_code == 401 and "metrics key" in closed.json()["error"]["message"]
    if metrics_key is None:
        assert "PROMPTCACHE_METRICS_KEY" in closed.json()["error"]["message"]
    else:
        opened = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {metrics_key}"})
        assert opened.status_code == 200 and "promptcache:" in opened.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_stay_open_without_tenants(live_server):
    server = live_server(api_keys=["sk-only"])
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_a_value_error_from_a_bug_is_a_500_with_an_error_id_not_a_400(live_server, caplog, monkeypatch):
    """No table row catches ValueError: bad input raises its package's invalid-request error, so a ValueError
    that reaches the table is a server fault, in a body and in a stream."""
    server = live_server()
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()

    def buggy_detokenize(token_ids):
        raise ValueError(f"bad slice in {SECRET}")

    monkeypatch.setattr(server.app.state.service.runtime, "detokenize", buggy_detokenize)
    caplog.set_level(logging.ERROR, logger="promptcache.server")
    plain = httpx.post(server.url + "/detokenize", json={"tokens": [1, 2]}, timeout=60)
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "internal_error"
    assert SECRET not in plain.text and SECRET in _logged(caplog, _error_id(plain.json()["error"]["message"]))
    body = {"prompt": PROMPT, "max_tokens": 2, "return_spans": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/generate", json=body, timeout=60) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["status"] == 500


@pytest.mark.parametrize("text", ["a lone \ud800 surrogate", "\udfff"])
def test_text_that_is_not_unicode_is_a_400_on_every_route_that_reads_text(live_server, text):
    """JSON's "\\ud800" escape decodes to a lone surrogate, which no tokenizer or XML parser takes: the PML
    routes answer invalid_pml and the plain ones invalid_request, naming what was wrong."""
    server = live_server()
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    chat = [{"role": "user", "content": text}]
    cases = [("/v1/schemas", {"pml": SCHEMA.replace("Cats", text)}, "invalid_pml"),
             ("/v1/generate", {"prompt": PROMPT.replace("Who", text), "max_tokens": 2}, "invalid_pml"),
             ("/v1/prompts/explain", {"prompt": PROMPT.replace("Who", text)}, "invalid_pml"),
             ("/v1/completions", {"prompt": text, "max_tokens": 2}, "invalid_request"),
             ("/v1/completions", {"prompt": text, "max_tokens": 2, "echo": True, "logprobs": 1}, "invalid_request"),
             ("/v1/chat/completions", {"messages": chat, "max_tokens": 2}, "invalid_request"),
             ("/v1/chat/completions", {"messages": chat, "max_tokens": 2, "schema": "docs"}, "invalid_pml"),
             ("/tokenize", {"prompt": text}, "invalid_request"),
             ("/tokenize", {"messages": chat}, "invalid_request")]
    surrogate = next(f"U+{ord(c):04X}" for c in text if 0xD800 <= ord(c) <= 0xDFFF)
    for path, body, kind in cases:
        # json.dumps writes the surrogate as the "\\udxxx" escape a client sends (UTF-8 cannot carry it)
        response = httpx.post(server.url + path, content=json.dumps(body), timeout=60,
                              headers={"content-type": "application/json"})
        error = response.json()["error"]
        assert (response.status_code, error["type"]) == (400, kind), (path, response.text)
        assert "not valid Unicode" in error["message"] and surrogate in error["message"], error


def test_cluster_errors_map_through_the_one_table(live_server, caplog, monkeypatch):
    """What the gateway and replicas raise gets its status from ERROR_TABLE like every other error: busy and
    lost replicas are public 503s with Retry-After; a cluster fault shows an error id only."""
    from promptcache.cluster import ClusterConfigError, ReplicaLostError, ReplicasBusyError, ReplicaStartError

    server = live_server()
    service = server.app.state.service
    caplog.set_level(logging.ERROR, logger="promptcache.server")
    cases = [(ReplicasBusyError("every replica is busy; retry shortly", retry_after_s=1), 503,
              "service_unavailable", "1", True),
             (ReplicaLostError("the replica stopped", retry_after_s=2), 503, "replica_lost", "2", True),
             (ReplicaStartError(f"cannot read {SECRET}"), 503, "service_unavailable", None, False),
             (ClusterConfigError(f"bad option in {SECRET}"), 500, "internal_error", None, False)]
    for exc, status, kind, retry_after, is_public in cases:
        def raising(token_ids, exc=exc):
            raise exc

        monkeypatch.setattr(service.runtime, "detokenize", raising)
        response = httpx.post(server.url + "/detokenize", json={"tokens": [1]}, timeout=60)
        error = response.json()["error"]
        assert (response.status_code, error["type"]) == (status, kind), response.text
        assert response.headers.get("retry-after") == retry_after
        if is_public:
            assert error["message"] == str(exc)
        else:
            assert SECRET not in response.text and SECRET in _logged(caplog, _error_id(error["message"]))


def test_a_schema_that_exists_is_one_409_whoever_finds_it(live_server, redis_server):
    """The server's check, the quota ledger's reservation and the shared registry raise the same
    SchemaExistsError: the second replica of a name gets the 409 the first one's duplicate gets."""
    from promptcache.cache_store import SchemaExistsError
    from promptcache.server.errors import status_for

    assert status_for(SchemaExistsError("x")) == (409, "schema_exists")
    first = live_server(redis_url=redis_server.url, tenant_max_schemas=5)
    second = live_server(redis_url=redis_server.url, tenant_max_schemas=5)
    assert httpx.post(first.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).status_code == 201
    for server in (first, second):
        again = httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60)
        assert again.status_code == 409 and again.json()["error"]["type"] == "schema_exists", again.text
        assert "SchemaExistsError" in again.json()["error"]["message"]
