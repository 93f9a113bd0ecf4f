"""Tenants by API key against the real server, a real Redis and the official `openai` client: auth, schema
namespaces, KV isolation (module and prefix), quotas, rate limits, signed Redis values, tenant metrics."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import redis

from tests.server.test_api import PROMPT, SCHEMA
from tests.server.test_prefix_caching import DOCUMENT

BLOB_KEY = "b" * 32
KEYS = {
    "keys": {"sk-a1": "alpha", "sk-a2": "alpha", "sk-b1": "beta", "sk-g1": "gamma", "sk-d1": "delta"},
    "quotas": {"gamma": {"rate_limit": "3/minute"}, "delta": {"max_schemas": 1, "max_schema_tokens": 400}},
}
OTHER_SCHEMA = SCHEMA.replace('name="docs"', 'name="secret-plans"')


@pytest.fixture
def tenant_server(live_server, redis_server, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))

    def start(**overrides):
        return live_server(api_keys_file=str(keys_file), redis_url=redis_server.url, blob_key=BLOB_KEY,
                           prefix_block_size=8, metrics_key="metrics-secret", **overrides)

    return start


def _http(server, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=120)


def _api(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _cached(client: openai.OpenAI, prompt: str, **extra) -> tuple[int, str]:
    reply = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body=extra or None)
    return reply.usage.prompt_tokens_details.cached_tokens, reply.choices[0].text


def test_missing_or_wrong_key_is_401(tenant_server):
    server = tenant_server()
    assert _http(server, None).get("/v1/schemas").status_code == 401
    reply = _http(server, "sk-nope").get("/v1/schemas")
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        _api(server, "sk-a1x").completions.create(model="m", prompt="hi", max_tokens=1)
    assert _http(server, None).get("/health").status_code == 200  # health stays open
    assert _http(server, None).get("/metrics").status_code == 401  # metrics has its own key
    assert _http(server, "sk-a1").get("/metrics").status_code == 401
    assert _http(server, "metrics-secret").get("/metrics").status_code == 200


def test_schemas_are_private_to_their_tenant(tenant_server):
    server = tenant_server()
    alpha, alpha2, beta = _http(server, "sk-a1"), _http(server, "sk-a2"), _http(server, "sk-b1")
    assert alpha.post("/v1/schemas", json={"pml": SCHEMA}).status_code == 201
    assert alpha.post("/v1/schemas", json={"pml": OTHER_SCHEMA}).status_code == 201
    assert alpha2.get("/v1/schemas/docs").status_code == 200  # same tenant, other key

    assert beta.get("/v1/schemas").json()["data"] == []
    assert beta.get("/v1/schemas/docs").status_code == 404
    assert beta.delete("/v1/schemas/docs").status_code == 404
    for reply in (beta.post("/v1/prompts/explain", json={"prompt": PROMPT}),
                  beta.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 2})):
        assert reply.status_code == 404
        assert "secret-plans" not in reply.text  # the error never lists another tenant's schemas
    with pytest.raises(openai.NotFoundError):
        _api(server, "sk-b1").chat.completions.create(model="m", messages=[{"role": "user", "content": "<d1/> hi"}],
                                                      max_tokens=2, extra_body={"schema": "docs"})

    alpha_tokens = alpha.get("/v1/schemas/docs").json()["num_tokens"]
    own = SCHEMA.replace("Cats sleep most of the day.", "Dogs bark at night. " * 5)
    assert beta.post("/v1/schemas", json={"pml": own}).status_code == 201  # the same name, beta's own
    assert beta.get("/v1/schemas/docs").json()["num_tokens"] > alpha_tokens
    assert alpha.get("/v1/schemas/docs").json()["num_tokens"] == alpha_tokens  # alpha's is untouched
    assert [s["name"] for s in alpha.get("/v1/schemas").json()["data"]] == ["docs", "secret-plans"]
    assert beta.delete("/v1/schemas/docs").status_code == 204
    assert alpha.get("/v1/schemas/docs").status_code == 200


def test_kv_of_one_tenant_is_never_a_hit_for_another(tenant_server):
    server = tenant_server()
    prompt = DOCUMENT + "Who sleeps?"
    first, reference = _cached(_api(server, "sk-a1"), prompt)
    assert first == 0
    hit, again = _cached(_api(server, "sk-a2"), prompt)  # alpha's other key: a hit
    assert hit > 0 and again == reference
    for salt in (None, "alpha", "\u0000tenant\u0000alpha"):
        extra = {"cache_salt": salt} if salt else {}
        if salt and "\u0000" in salt:  # no client salt can spell a server-derived one
            with pytest.raises(openai.UnprocessableEntityError, match="cache_salt"):
                _cached(_api(server, "sk-b1"), prompt, **extra)
            continue
        missed, text = _cached(_api(server, "sk-b1"), prompt, **extra)
        assert missed == 0 and text == reference  # same answer, computed afresh
    hit, _ = _cached(_api(server, "sk-b1"), prompt)
    assert hit > 0  # beta's own repeat hits its own KV
    salted, _ = _cached(_api(server, "sk-a1"), prompt, cache_salt="x")  # a client salt subdivides alpha's cache
    assert salted == 0


def test_module_kv_is_encoded_per_tenant(tenant_server):
    server = tenant_server()
    metrics = _http(server, "metrics-secret")

    def encodings() -> float:
        for line in metrics.get("/metrics").text.splitlines():
            if line.startswith("promptcache:module_encodings"):
                return float(line.split()[-1])
        raise AssertionError("no module_encodings metric")

    before = encodings()
    assert _http(server, "sk-a1").post("/v1/schemas", json={"pml": SCHEMA}).status_code == 201
    alpha_encoded = encodings() - before
    assert alpha_encoded > 0
    explained = _http(server, "sk-a1").post("/v1/prompts/explain", json={"prompt": PROMPT}).json()
    assert all(m["tier"] is not None for m in explained["modules"])  # alpha sees its modules cached
    assert _http(server, "sk-b1").post("/v1/schemas", json={"pml": SCHEMA}).status_code == 201
    assert encodings() - before == 2 * alpha_encoded  # identical text, encoded again under beta's salt
    same = [_http(server, k).post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0})
            for k in ("sk-a1", "sk-b1")]
    assert same[0].json()["choices"][0]["text"] == same[1].json()["choices"][0]["text"]
    text = metrics.get("/metrics").text
    assert 'tenant="alpha"' in text and 'tenant="beta"' in text
    assert any(line.startswith("promptcache:request_success_total") and 'tenant="beta"' in line
               for line in text.splitlines())


def test_quotas_and_rate_limits_answer_429(tenant_server):
    server = tenant_server()
    delta = _http(server, "sk-d1")
    assert delta.post("/v1/schemas", json={"pml": SCHEMA}).status_code == 201
    over = delta.post("/v1/schemas", json={"pml": OTHER_SCHEMA})
    assert over.status_code == 429 and over.json()["error"]["type"] == "quota_exceeded"
    assert "quota is 1" in over.json()["error"]["message"]
    assert delta.delete("/v1/schemas/docs").status_code == 204
    long_doc = SCHEMA.replace("Tea is brewed hot.", "Tea is brewed hot. " * 120)
    too_long = delta.post("/v1/schemas", json={"pml": long_doc})
    assert too_long.status_code == 429 and "400" in too_long.json()["error"]["message"]

    gamma = _http(server, "sk-g1")
    statuses = [gamma.get("/v1/schemas") for _ in range(4)]
    assert [r.status_code for r in statuses[:3]] == [200, 200, 200]
    limited = statuses[3]
    assert limited.status_code == 429 and limited.json()["error"]["type"] == "rate_limit_exceeded"
    assert 1 <= int(limited.headers["retry-after"]) <= 60
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-g1", max_retries=0).models.list()
    assert _http(server, "sk-a1").get("/v1/schemas").status_code == 200  # other tenants are not limited


def test_second_replica_shares_a_tenants_schemas_and_refuses_tampered_kv(tenant_server, redis_server):
    one, two = tenant_server(), tenant_server()
    assert _http(one, "sk-a1").post("/v1/schemas", json={"pml": SCHEMA}).status_code == 201
    assert _http(two, "sk-a2").get("/v1/schemas/docs").status_code == 200  # alpha's, via the shared registry
    assert _http(two, "sk-b1").get("/v1/schemas/docs").status_code == 404
    raw = redis.Redis.from_url(redis_server.url)
    assert all(raw.get(k).startswith(b"PCMAC1") for k in raw.scan_iter("promptcache:default:schema:*"))

    honest_prompt = DOCUMENT + "What is tea brewed with?"
    _settled(raw, lambda: _cached(_api(one, "sk-a1"), honest_prompt))
    hit, _ = _cached(_api(two, "sk-a1"), honest_prompt)
    assert hit > 0  # the second replica reuses alpha's prefix blocks through Redis

    prompt = "A different text entirely: seven swans swim south while ravens rest on the old stone wall. " * 3
    _, reference = _settled(raw, lambda: _cached(_api(one, "sk-a1"), prompt))
    for key in raw.scan_iter("promptcache:default:kv:*"):  # flip one bit in every KV blob
        blob = raw.get(key)
        raw.set(key, blob[:-1] + bytes([blob[-1] ^ 1]))
    tampered_hits, text = _cached(_api(two, "sk-a1"), prompt)
    assert tampered_hits == 0 and text == reference  # nothing tampered is served; the answer is recomputed


def _settled(raw: redis.Redis, request):
    """Run `request`, then wait until its KV blobs reached Redis (writes are write-behind)."""
    before = sum(1 for _ in raw.scan_iter("promptcache:default:kv:*"))
    result = request()
    deadline, last, stable_since = time.monotonic() + 15, -1, time.monotonic()
    while time.monotonic() < deadline:
        count = sum(1 for _ in raw.scan_iter("promptcache:default:kv:*"))
        if count != last:
            last, stable_since = count, time.monotonic()
        elif count > before and time.monotonic() - stable_since > 0.5:
            return result
        time.sleep(0.05)
    raise AssertionError("the request's KV did not reach Redis")


@pytest.mark.parametrize("share", [0.5, None])
def test_a_tenant_at_its_cache_share_cannot_evict_anothers_kv(live_server, tmp_path, share):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"sk-a": "alpha", "sk-b": "beta"}))
    server = live_server(api_keys_file=str(keys_file), tenant_cache_share=share, prefix_block_size=8,
                         device_max_bytes=48 << 10, host_max_bytes=48 << 10)  # ~96 tokens of tiny-llama KV each
    beta_prompt = "Beta keeps a short note about tea and cats. " * 2
    _cached(_api(server, "sk-b"), beta_prompt)
    assert _cached(_api(server, "sk-b"), beta_prompt)[0] > 0
    for i in range(6):  # alpha floods both tiers several times over
        _cached(_api(server, "sk-a"), f"Alpha document {i}: " + "rivers run north past old mills. " * 6)
    kept, _ = _cached(_api(server, "sk-b"), beta_prompt)
    if share is not None:
        assert kept > 0  # beta's blocks, within its share, survived alpha's flood
    else:
        assert kept == 0  # the control: without shares, plain LRU evicted them
