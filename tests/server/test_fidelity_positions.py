"""Fidelity positions over HTTP: fast mode re-aligns reused keys to contiguous positions by default and
keeps the layout's on request, each answering like its explicit-mask oracle (tests/model_runtime/oracles.py)."""

from __future__ import annotations

import httpx
import pytest
import torch

from promptcache.model_runtime.baseline import full_prefill_logits
from promptcache.model_runtime.engine import Fidelity, resolve
from tests.conftest import make_tiny_runtime
from tests.model_runtime.oracles import reuse_reference
from tests.server.test_api import SCHEMA

APPROXIMATE = '<prompt schema="docs"><d2/>Who sleeps?</prompt>'  # d2 without the modules before it: a gap
OUT_OF_CONTEXT = '<prompt schema="docs"><user>Read: <d2/>Who sleeps?</user><assistant/></prompt>'  # text first


@pytest.fixture
def server(live_server):
    return live_server()  # fidelity fast, positions the server default


def test_fast_is_contiguous_by_default_and_layout_on_request(server):
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    plan = runtime.plan(APPROXIMATE, add_generation_prompt=True)  # as the server parses it
    firsts = {}
    for asked, expected in [(None, "contiguous"), ("layout", "layout"), ("contiguous", "contiguous")]:
        body = httpx.post(server.url + "/v1/generate", timeout=60, json={
            "prompt": APPROXIMATE, "max_tokens": 1, "temperature": 0, "logprobs": 1, "fidelity": "fast",
            "fidelity_positions": asked}).json()
        assert body["cache"]["positions"] == expected and body["cache"]["exact"] is False
        reuse = resolve(plan, Fidelity("fast", positions=expected))
        assert reuse.positions == expected  # the prompt has a gap: re-aligning moves it
        tokens, positions, mask = reuse_reference(plan, reuse)
        reference = torch.log_softmax(full_prefill_logits(runtime.loaded.model, tokens, positions, mask)[-1], -1)
        logprobs = body["choices"][0]["logprobs"]
        first = logprobs["token_ids"][0]
        assert first == int(reference.argmax())
        assert abs(logprobs["token_logprobs"][0] - reference[first].item()) < 1e-4
        firsts[expected] = logprobs["token_logprobs"][0]
    assert firsts["contiguous"] != firsts["layout"]  # the two really differ
    explained = [httpx.post(server.url + "/v1/prompts/explain", json={
        "prompt": APPROXIMATE, "fidelity": "fast", "fidelity_positions": p}).json()["positions"]
        for p in (None, "layout")]
    assert explained == ["contiguous", "layout"]
    bad = httpx.post(server.url + "/v1/generate", json={"prompt": APPROXIMATE, "fidelity_positions": "packed"})
    assert bad.status_code == 422 and "fidelity_positions" in bad.text


def test_an_exact_prompt_keeps_its_layout(server):
    """Re-aligning applies to approximate prompts only: an in-context module keeps its positions (the
    answer a full prefill at the layout's positions gives)."""
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    prompt = '<prompt schema="docs"><user><d1/>Who sleeps?</user><assistant/></prompt>'
    cache = httpx.post(server.url + "/v1/generate", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "fidelity": "fast"}).json()["cache"]
    assert cache["exact"] is True and cache["positions"] == "layout"


def test_openai_routes_take_fidelity_positions_as_an_extra_body_field(server):
    import openai

    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    reports = [api.completions.create(model="tiny-llama", prompt=APPROXIMATE, max_tokens=1, temperature=0,
                                      extra_body={"fidelity": "fast", "fidelity_positions": p}
                                      ).model_extra["promptcache"]["positions"] for p in ("layout", "contiguous")]
    assert reports == ["layout", "contiguous"]


def test_fidelity_context_predecessor_over_http_sdk_and_explain(server):
    """`fidelity_context: predecessor` reuses d2's second encoding (after d1, the module before it): the
    answer is its oracle's, the response and explain name it, the SDK passes it, a bad value is a 422."""
    from promptcache.clients import Client

    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    plan = runtime.plan(OUT_OF_CONTEXT)
    fidelity = Fidelity("fast", positions="contiguous", context="predecessor")
    reuse = resolve(plan, fidelity)
    assert reuse.encoded_after(plan.schema) == {"d2": "d1"}
    tokens, positions, mask = reuse_reference(plan, reuse)
    reference = torch.log_softmax(full_prefill_logits(runtime.loaded.model, tokens, positions, mask)[-1], -1)
    def explain() -> dict:
        return httpx.post(server.url + "/v1/prompts/explain", json={
            "prompt": OUT_OF_CONTEXT, "fidelity": "fast", "fidelity_context": "predecessor"}).json()

    # The schema's scaffold "d1 d2" encoded d2 after d1 at upload: the same context, so the same stored KV.
    before = explain()
    assert before["modules"][0]["tier"] == "device" and before["modules"][0]["encoded_after"] == "d1"
    body = httpx.post(server.url + "/v1/generate", timeout=60, json={
        "prompt": OUT_OF_CONTEXT, "max_tokens": 1, "temperature": 0, "logprobs": 1, "fidelity": "fast",
        "fidelity_context": "predecessor"}).json()
    assert body["cache"]["context"] == "predecessor"
    assert [(m["path"], m["encoded_after"]) for m in body["cache"]["modules"]] == [("d2", "d1")]
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["token_ids"][0] == int(reference.argmax())
    assert abs(logprobs["token_logprobs"][0] - reference[logprobs["token_ids"][0]].item()) < 1e-4
    plain = httpx.post(server.url + "/v1/generate", timeout=60, json={
        "prompt": OUT_OF_CONTEXT, "max_tokens": 1, "temperature": 0, "logprobs": 1, "fidelity": "fast"}).json()
    assert plain["cache"]["context"] == "schema" and plain["cache"]["modules"][0]["encoded_after"] is None
    assert plain["choices"][0]["logprobs"]["token_logprobs"][0] != logprobs["token_logprobs"][0]
    explained = explain()
    assert explained["context"] == "predecessor" and explained["modules"][0]["encoded_after"] == "d1"
    with Client(server.url, max_retries=0) as client:
        generation = client.generate(OUT_OF_CONTEXT, max_tokens=1, fidelity="fast", fidelity_context="predecessor")
    assert generation.cache.context == "predecessor" and generation.cache.modules[0].encoded_after == "d1"
    bad = httpx.post(server.url + "/v1/generate", json={"prompt": OUT_OF_CONTEXT, "fidelity_context": "neighbour"})
    assert bad.status_code == 422 and "fidelity_context" in bad.text
