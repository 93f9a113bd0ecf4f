"""`return_spans` on /v1/generate over HTTP with a real server: absent unless asked, every prompt token
once, texts that join to the prompt the tokenizer decodes, sums that match usage, JSON and SSE alike."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from promptcache.server.generation import span_texts
from tests.conftest import make_tiny_runtime
from tests.model_factories import make_test_tokenizer
from tests.model_runtime.test_fidelity import PROMPTS as LIB_PROMPTS
from tests.model_runtime.test_fidelity import SCHEMA as LIB_SCHEMA
from tests.server.conftest import LiveServer, settings_for
from tests.server.test_api import PROMPT, SCHEMA

EMOJI_PROMPT = ('<prompt schema="docs"><user><d2/><d1/>Qui dort? Le chat 🐱 dort, café ☕ après.</user>'
                '<assistant/></prompt>')


def _expected_text(prompt: str) -> tuple[str, int]:
    """The oracle: the prompt's tokens (as the server plans them) decoded by the tokenizer in one go."""
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA), encode=False)
    runtime.add_schema(runtime.parse_schema(LIB_SCHEMA), encode=False)
    token_ids = runtime.plan(prompt).token_ids()
    return runtime.loaded.tokenizer.decode(token_ids), len(token_ids)


def _generate(server, **body) -> dict:
    response = httpx.post(server.url + "/v1/generate", json={"max_tokens": 3, "temperature": 0, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(server, **body) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.url + "/v1/generate", timeout=120,
                      json={"max_tokens": 3, "temperature": 0, "stream": True, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _check(cache: dict, usage: dict, prompt: str) -> list[dict]:
    spans = cache["spans"]
    text, num_tokens = _expected_text(prompt)
    assert "".join(s["text"] for s in spans) == text
    assert sum(s["num_tokens"] for s in spans) == usage["prompt_tokens"] == num_tokens
    assert sum(s["num_tokens"] for s in spans if s["origin"] in ("module", "prefix")) == usage["cached_tokens"]
    # Recomputed tokens are the ones this request computed itself: a repeat's come from prefix blocks.
    assert sum(s["num_tokens"] for s in spans if s["origin"] == "recomputed") == cache["recomputed_tokens"]
    assert sum(m["recomputed_tokens"] for m in cache["modules"]) == cache["recomputed_tokens"]
    starts = [s["start"] for s in spans]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    for span in spans:
        assert span["origin"] in ("module", "prefix", "recomputed", "computed") and span["num_tokens"] > 0
        assert (span["tier"] in ("device", "host", "redis", "disk")) == (span["origin"] in ("module", "prefix"))
    return spans


@pytest.fixture
def server(live_server):
    server = live_server(prefix_block_size=4, logits_cache_bytes=0)
    for schema in (SCHEMA, LIB_SCHEMA):
        httpx.post(server.url + "/v1/schemas", json={"pml": schema}, timeout=120).raise_for_status()
    return server


def test_spans_only_when_asked_json_and_sse(server):
    plain = _generate(server, prompt=PROMPT)
    assert "spans" not in plain["cache"] and set(plain["cache"]) == {
        "exact", "generation_prompt_added", "fidelity", "positions", "context", "recomputed_tokens", "approximations",
        "modules", "prefix"}
    final = [c for c in _stream(server, prompt=PROMPT) if "usage" in c]
    assert len(final) == 1 and "spans" not in final[0]["cache"]

    first = _generate(server, prompt=EMOJI_PROMPT, return_spans=True)
    spans = _check(first["cache"], first["usage"], EMOJI_PROMPT)
    assert {s["module"] for s in spans if s["origin"] == "module"} == {"d1", "d2", None}  # None: the system text
    assert {s["tier"] for s in spans if s["origin"] == "module"} == {"device"}
    assert any(s["origin"] == "computed" and "🐱" in s["text"] for s in spans)

    # A repeat, streamed with n=2: one report, its new text now from prefix blocks (the last token,
    # computed for its logits, may split the last character's bytes across two spans).
    chunks = _stream(server, prompt=EMOJI_PROMPT, return_spans=True, n=2, temperature=1.0, seed=1)
    reports = [c["cache"] for c in chunks if "cache" in c]
    assert len(reports) == 1
    usage = next(c["usage"] for c in chunks if "usage" in c)
    again = _check(reports[0], usage, EMOJI_PROMPT)
    assert [s["origin"] for s in again if s["origin"] not in ("module", "prefix")] == ["computed"]
    assert sum(s["num_tokens"] for s in again if s["origin"] == "prefix") == usage["prompt_tokens"] - sum(
        s["num_tokens"] for s in again if s["origin"] == "module") - 1


@pytest.mark.parametrize("fidelity", ["balanced", "exact"])
def test_recomputed_spans_sum_to_the_reported_recomputed_tokens(server, fidelity):
    prompt = LIB_PROMPTS[0]  # d2 after d0: d2 was encoded without d0 before it
    body = _generate(server, prompt=prompt, return_spans=True, fidelity=fidelity)
    spans = _check(body["cache"], body["usage"], prompt)
    assert body["cache"]["recomputed_tokens"] > 0
    assert sum(s["num_tokens"] for s in spans if s["origin"] == "recomputed") == body["cache"]["recomputed_tokens"]
    assert {s["module"] for s in spans if s["origin"] == "recomputed"} == {
        m["path"] for m in body["cache"]["modules"] if m["recomputed_tokens"]} >= {"d2"}


@pytest.mark.parametrize("fidelity", ["balanced", "exact"])
def test_a_repeat_reports_its_recomputed_tokens_as_reused_prefix_not_recomputed(server, fidelity):
    prompt = LIB_PROMPTS[0]
    first = _generate(server, prompt=prompt, return_spans=True, fidelity=fidelity)
    again = _generate(server, prompt=prompt, return_spans=True, fidelity=fidelity)
    _check(again["cache"], again["usage"], prompt)
    recomputed = first["cache"]["recomputed_tokens"]
    assert recomputed > 0
    # The repeat reuses the first one's stream (its recomputed tokens included) up to the last token,
    # computed for its logits (no logits cache on this server): it recomputes nothing itself.
    assert again["usage"]["computed_tokens"] == 1 and again["cache"]["recomputed_tokens"] == 0
    assert all(m["recomputed_tokens"] == 0 for m in again["cache"]["modules"])
    assert again["usage"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_span_texts_join_to_the_whole_decode():
    """Cut anywhere, even inside a character's bytes: the texts join to the tokens decoded together."""
    tokenizer = make_test_tokenizer()
    ids = tokenizer.encode("Le chat 🐱 dort; café ☕ après — naïve 東京 déjà vu. " * 3, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(ids)), 6))
        runs = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        assert "".join(span_texts(runs, tokenizer.decode)) == tokenizer.decode(ids)


@pytest.mark.timeout(600)
def test_spans_with_the_default_model(smollm2):
    """SmolLM2's own tokenizer and chat template: the texts join to its decode of the prompt's tokens."""
    server = LiveServer(settings_for(prefix_block_size=4), lambda: smollm2).start()
    try:
        httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=300).raise_for_status()
        body = _generate(server, prompt=EMOJI_PROMPT, return_spans=True, max_tokens=1)
        text = "".join(s["text"] for s in body["cache"]["spans"])
        service = server.app.state.service
        assert text == smollm2.tokenizer.decode(service.plan(EMOJI_PROMPT).token_ids())
        assert sum(s["num_tokens"] for s in body["cache"]["spans"]) == body["usage"]["prompt_tokens"]
        assert {s["origin"] for s in body["cache"]["spans"]} == {"module", "computed"}
    finally:
        server.stop()
