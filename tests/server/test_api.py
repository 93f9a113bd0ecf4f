"""The native REST API end to end over HTTP: schemas, generation (JSON and SSE), explain, errors."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from promptcache.model_runtime import SamplingParams, wrap_model
from tests.conftest import make_tiny_runtime
from tests.model_factories import make_test_tokenizer, make_tiny_model
from tests.model_runtime.oracles import reference_text, reference_tokens

# Lower-cases each message: the content is not copied verbatim, so no per-role prefix and suffix can be split from it.
UNSPLITTABLE_TEMPLATE = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] | lower + '\\n' }}{% endfor %}"
SCHEMA = """<schema name="docs"><system>Answer from the documents.</system>
  <user><module name="d1">Cats sleep most of the day.</module><module name="d2">Tea is brewed hot.</module></user>
  <scaffold modules="d1 d2"/>
</schema>"""
PROMPT = '<prompt schema="docs"><user><d1/><d2/>Who sleeps?</user><assistant/></prompt>'


@pytest.fixture
def server(live_server):
    return live_server()


def test_schema_lifecycle(server):
    created = httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60)
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["name"] == "docs" and body["encode_ms"] >= 0
    d1 = next(m for m in body["modules"] if m["name"] == "d1")
    assert d1["path"] == "d1" and d1["end"] - d1["start"] == d1["num_tokens"] > 0
    assert httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).status_code == 409
    assert [s["name"] for s in httpx.get(server.url + "/v1/schemas").json()["data"]] == ["docs"]
    assert httpx.get(server.url + "/v1/schemas/docs").json()["num_tokens"] == body["num_tokens"]
    assert httpx.get(server.url + "/v1/schemas/nope").status_code == 404
    assert httpx.delete(server.url + "/v1/schemas/docs").status_code == 204
    assert httpx.delete(server.url + "/v1/schemas/docs").status_code == 404
    assert httpx.post(server.url + "/v1/generate", json={"prompt": PROMPT}).status_code == 404


def test_generate_matches_the_hf_reference(server):
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    response = httpx.post(server.url + "/v1/generate", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0},
                          timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA), encode=False)
    plan = runtime.plan(PROMPT, add_generation_prompt=True)  # as the server parses it
    fidelity = server.app.state.service.runtime.engine.config.fidelity  # the server's default mode
    expected = reference_tokens(runtime.loaded, plan, SamplingParams(max_tokens=6, temperature=0), fidelity)
    assert body["choices"][0]["text"] == reference_text(runtime.loaded, expected)
    assert body["usage"]["prompt_tokens"] == plan.num_prompt_tokens
    assert body["usage"]["cached_tokens"] == plan.num_cached_tokens
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert body["cache"]["exact"] is True  # the scaffold covers d1 + d2
    assert {m["path"]: m["tier"] for m in body["cache"]["modules"]} == {"d1": "device", "d2": "device"}
    assert body["timings"]["ttft_ms"] > 0


def test_streaming_sse(server):
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    plain = httpx.post(server.url + "/v1/generate", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                       timeout=60).json()
    chunks = []
    with httpx.stream("POST", server.url + "/v1/generate", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[0]


def test_explain_reports_tiers_without_generating(server):
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    body = httpx.post(server.url + "/v1/prompts/explain",
                      json={"prompt": '<prompt schema="docs"><d2/>Q</prompt>'}).json()
    assert body["schema"] == "docs" and body["exact"] is False and body["approximations"]
    assert body["modules"] == [{"path": "d2", "num_tokens": body["modules"][0]["num_tokens"], "tier": "device",
                                "recomputed_tokens": 0, "encoded_after": None}]
    assert body["fidelity"] == "fast" and body["recomputed_tokens"] == 0 and body["context"] == "schema"
    assert body["tokens_to_compute"] > 0 and body["cached_tokens"] > 0
    salted = httpx.post(server.url + "/v1/prompts/explain", json={"prompt": PROMPT, "cache_salt": "tenant-a"}).json()
    assert all(m["tier"] is None for m in salted["modules"])  # another tenant's KV is never shared


@pytest.mark.parametrize(("payload", "status", "kind"), [
    ({"pml": "<schema name='x'><module name='a'>oops</schema>"}, 400, "invalid_pml"),
    ({"pml": "<schema name='x'><bogus/></schema>"}, 400, "invalid_pml"),
    ({"pml": '<!DOCTYPE x [<!ENTITY a "b">]><schema name="x"/>'}, 400, "invalid_pml"),
    ({"wrong": 1}, 422, "invalid_request"),
])
def test_schema_errors(server, payload, status, kind):
    response = httpx.post(server.url + "/v1/schemas", json=payload, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == kind and error["message"]


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"prompt": '<prompt schema="docs"><d9/></prompt>'}, 400, "d9"),
    ({"prompt": '<prompt schema="docs"><user><d1/><d1/></user></prompt>'}, 400, "twice"),
    ({"prompt": "<prompt schema='docs'>if a<b: c</prompt>"}, 400, "&lt;"),  # a bare `<` that looks like a tag
    ({"prompt": PROMPT, "max_tokens": 0}, 422, "max_tokens"),
    ({"prompt": PROMPT, "temperature": -1}, 422, "temperature"),
    ({"prompt": PROMPT, "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": PROMPT, "surprise": True}, 400, "surprise"),
])
def test_generate_errors_are_4xx_naming_the_problem(server, body, status, needle):
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    response = httpx.post(server.url + "/v1/generate", json=body)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"]


def test_request_size_limit(live_server):
    server = live_server(max_request_bytes=2000)
    response = httpx.post(server.url + "/v1/schemas", json={"pml": "<schema name='big'>" + "x" * 5000 + "</schema>"})
    assert response.status_code == 413 and response.json()["error"]["type"] == "payload_too_large"


def test_api_keys(live_server):
    server = live_server(api_keys=["s3cret"])
    assert httpx.get(server.url + "/v1/schemas").status_code == 401
    assert httpx.get(server.url + "/v1/schemas", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(server.url + "/v1/schemas", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics stay open


def test_health_is_503_while_loading(live_server):
    gate = threading.Event()

    def slow_loader():
        gate.wait(30)
        from tests.model_factories import make_tiny_loaded

        return make_tiny_loaded("llama")

    server = live_server(loader=slow_loader, ready=False)
    assert httpx.get(server.url + "/health").status_code == 503
    assert httpx.get(server.url + "/v1/schemas").status_code == 503
    gate.set()
    for _ in range(200):
        if httpx.get(server.url + "/health").status_code == 200:
            break
        threading.Event().wait(0.05)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_metrics_exposes_vllm_style_names(server):
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    httpx.post(server.url + "/v1/generate", json={"prompt": PROMPT, "max_tokens": 3}, timeout=60).raise_for_status()
    text = httpx.get(server.url + "/metrics").text
    for name in ("promptcache:time_to_first_token_seconds_bucket", "promptcache:prompt_tokens_total",
                 "promptcache:generation_tokens_total", 'promptcache:cache_queries_total{tier="device"}',
                 'promptcache:cache_hits_total{tier="device"}', "promptcache:num_requests_running",
                 "promptcache:num_requests_waiting"):
        assert name in text, name
    assert 'promptcache:generation_tokens_total{model_name="tiny-llama"} 3.0' in text


def test_generate_logprobs_and_fidelity_report(server):
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    prompt = '<prompt schema="docs"><user><d2/>Who sleeps?</user><assistant/></prompt>'
    body = httpx.post(server.url + "/v1/generate", timeout=60, json={
        "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2, "fidelity": "exact"}).json()
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    plan = runtime.plan(prompt)
    from promptcache.model_runtime.baseline import full_prefill_logits

    reference = torch.log_softmax(full_prefill_logits(runtime.loaded.model, plan.token_ids())[-1], dim=-1)
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 3 and all(len(top) <= 2 for top in logprobs["top_logprobs"])
    first = logprobs["token_ids"][0]
    assert first == int(reference.argmax()) and abs(logprobs["token_logprobs"][0] - reference[first].item()) < 1e-4
    assert body["cache"]["fidelity"] == "exact" and body["cache"]["exact"] is True
    assert body["cache"]["recomputed_tokens"] == body["cache"]["modules"][0]["recomputed_tokens"] > 0
    approximate = '<prompt schema="docs"><d2/>Who sleeps?</prompt>'  # text outside the turn: d2 lacks its context
    balanced = httpx.post(server.url + "/v1/generate", timeout=60, json={
        "prompt": approximate, "max_tokens": 1, "fidelity": "balanced"}).json()["cache"]
    assert balanced["fidelity"] == "balanced" and balanced["exact"] is False and balanced["approximations"]
    assert balanced["recomputed_tokens"] > 0
    bad = httpx.post(server.url + "/v1/generate", json={"prompt": prompt, "fidelity": "perfect"})
    assert bad.status_code == 422 and "fidelity" in bad.text


def test_the_default_fidelity_answers_like_a_full_prefill(live_server):
    """A request that names no mode gets the server default (exact): an out-of-order module is recomputed."""
    from promptcache.server.settings import ServerSettings

    server = live_server(fidelity=ServerSettings.model_fields["fidelity"].default)
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).raise_for_status()
    prompt = '<prompt schema="docs"><user><d2/>Who sleeps?</user><assistant/></prompt>'
    body = httpx.post(server.url + "/v1/generate", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1}).json()
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    from promptcache.model_runtime.baseline import full_prefill_logits

    logits = full_prefill_logits(runtime.loaded.model, runtime.plan(prompt).token_ids())[-1]
    reference = torch.log_softmax(logits, dim=-1)
    first = body["choices"][0]["logprobs"]["token_ids"][0]
    assert body["cache"]["fidelity"] == "exact" and body["cache"]["exact"] is True
    assert first == int(reference.argmax())
    assert abs(body["choices"][0]["logprobs"]["token_logprobs"][0] - reference[first].item()) < 1e-4


def test_examples_a_model_cannot_take_are_skipped_at_startup(live_server):
    """A template that alters message content cannot be split per role: the bundled examples' role tags are left out
    with a warning and the server starts without them."""
    tokenizer = make_test_tokenizer.__wrapped__()
    tokenizer.chat_template = UNSPLITTABLE_TEMPLATE
    model = make_tiny_model("llama", vocab_size=len(tokenizer))
    server = live_server(lambda: wrap_model(model, tokenizer, name="tiny-unsplittable"), preload_examples=True)
    assert httpx.get(server.url + "/v1/schemas").json()["data"] == []
    assert httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).status_code == 400  # role tags
