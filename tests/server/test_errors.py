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
    assert httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).status_code == 201
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
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    service = server.app.state.service

    def broken_detokenize(token_ids):
        raise OSError(f"cannot read {SECRET}")

    monkeypatch.setattr(service, "detokenize", broken_detokenize)
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
