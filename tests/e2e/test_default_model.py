"""The README's serve path: the built-in SmolLM2, loaded as `promptcache serve` loads it by default (its GGUF is
4-bit: int4 weights as stored where an int4 product with vector code runs), with the example schemas preloaded
gives real answers."""

from __future__ import annotations

import httpx
import pytest

from promptcache.model_runtime import LoadedModel, WeightFormat, load_model
from promptcache.model_runtime.loading.quantized_linear import int4_is_fast
from tests.server.conftest import LiveServer, settings_for


@pytest.fixture(scope="module")
def served_default() -> LoadedModel:
    return load_model(settings_for().load_config())


def test_default_model_answers_from_the_preloaded_example(served_default):
    # The settings' default, auto: the Q4_1 GGUF as stored where an int4 product has vector code, else widened.
    expected = WeightFormat.INT4 if int4_is_fast(served_default.model.dtype) else WeightFormat.NATIVE
    assert served_default.weights is expected
    server = LiveServer(settings_for(preload_examples=True), lambda: served_default).start()
    try:
        assert httpx.get(server.url + "/health").json()["weights"] == expected.value
        names = [s["name"] for s in httpx.get(server.url + "/v1/schemas").json()["data"]]
        assert {"library", "trip-planner"} <= set(names)
        prompt = ('<prompt schema="library"><user><doc-amazon/>Into which ocean does the Amazon flow?</user>'
                  "<assistant/></prompt>")
        body = httpx.post(server.url + "/v1/generate", json={"prompt": prompt, "max_tokens": 24, "temperature": 0},
                          timeout=120).json()
        assert "Atlantic" in body["choices"][0]["text"]
        assert body["cache"]["exact"] is True and body["usage"]["cached_tokens"] > 40
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}).json()
        assert "Paris" in chat["choices"][0]["message"]["content"]
    finally:
        server.stop()
