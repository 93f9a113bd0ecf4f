"""One cache report on every route: /v1/generate's JSON `cache`, its last streamed chunk's `cache` and the
OpenAI routes' `promptcache` object carry the same fields (context, and per module `encoded_after`), and
say the same about the same prompt. The empty schema plain prompts run against is nobody's: it is never
listed, named in an error, or in the way of a schema a user uploads."""

from __future__ import annotations

import json

import httpx
import pytest

THREE = """<schema name="three"><system>Answer from the notes.</system><user>
  <module name="m1">Cats sleep most of the day.</module>
  <module name="m2"> Tea is brewed hot.</module>
  <module name="m3"> Rome is old.</module>
</user></schema>"""
# m3 after m1 (m2 left out) is out of its context; `predecessor` reuses its KV encoded after m2.
PROMPT = '<prompt schema="three"><user><m1/><m3/>How old is Rome?</user><assistant/></prompt>'
FIDELITY = {"fidelity": "fast", "fidelity_context": "predecessor"}


@pytest.fixture
def server(live_server):
    server = live_server()
    httpx.post(server.url + "/v1/schemas", json={"pml": THREE}, timeout=60).raise_for_status()
    return server


def _generate(server, **fields) -> dict:
    response = httpx.post(server.url + "/v1/generate", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, **FIDELITY, **fields})
    response.raise_for_status()
    return response.json()


def _last_chunk(server) -> dict:
    with httpx.stream("POST", server.url + "/v1/generate", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True, **FIDELITY}) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])


def _reuse(report: dict) -> tuple:
    """What a report says about the prompt's modules, apart from where this request found their KV."""
    return (report["exact"], report["fidelity"], report["positions"], report["context"],
            [(m["path"], m["num_tokens"], m["recomputed_tokens"], m["encoded_after"]) for m in report["modules"]])


def test_every_route_reports_context_and_encoded_after_alike(server):
    cache = _generate(server)["cache"]
    assert cache["context"] == "predecessor"
    assert {m["path"]: m["encoded_after"] for m in cache["modules"]} == {"m1": None, "m3": "m2"}
    chunk = _last_chunk(server)["cache"]
    completion = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "m", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, **FIDELITY}).json()["promptcache"]
    assert set(chunk) == set(cache) and set(completion) == set(cache) | {"timings"}
    for module in chunk["modules"] + completion["modules"]:
        assert set(module) == set(cache["modules"][0])  # encoded_after present, null or not
    assert _reuse(chunk) == _reuse(completion) == _reuse(cache)
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "schema": "three", "max_tokens": 3, "temperature": 0, **FIDELITY,
        "messages": [{"role": "user", "content": "<m1/><m3/>How old is Rome?"}]}).json()["promptcache"]
    assert set(chat) == set(completion) and chat["context"] == "predecessor"
    assert {m["path"]: m["encoded_after"] for m in chat["modules"]} == {"m1": None, "m3": "m2"}


def test_the_stream_reports_spans_only_when_asked(server):
    assert "spans" not in _last_chunk(server)["cache"]
    with httpx.stream("POST", server.url + "/v1/generate", timeout=60, json={
            "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True, "return_spans": True}) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    spans = json.loads(events[-2])["cache"]["spans"]
    assert spans and all(set(s) == {"start", "num_tokens", "origin", "module", "tier", "text"} for s in spans)


def test_the_plain_schema_is_nobodys(server):
    unknown = httpx.post(server.url + "/v1/generate", json={"prompt": '<prompt schema="nope">Hi</prompt>'}).json()
    assert unknown["error"]["type"] == "schema_not_found"
    assert "['three']" in unknown["error"]["message"] and "plain" not in unknown["error"]["message"]
    assert [s["name"] for s in httpx.get(server.url + "/v1/schemas").json()["data"]] == ["three"]
    for name in ("plain", "__plain__"):  # names like the internal one are a user's to take
        schema = f'<schema name="{name}"><user><module name="doc">A note.</module></user></schema>'
        assert httpx.post(server.url + "/v1/schemas", json={"pml": schema}, timeout=60).status_code == 201
        prompt = f'<prompt schema="{name}"><user><doc/>What is it?</user><assistant/></prompt>'
        answer = httpx.post(server.url + "/v1/generate", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
        assert answer.status_code == 200 and answer.json()["cache"]["modules"][0]["path"] == "doc"
    plain = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert plain.status_code == 200 and plain.json()["promptcache"]["modules"] == []
