"""The server's default fidelity context over HTTP: `fast` and `balanced` requests that name none reuse
each out-of-context module's second encoding (made on its first use, not at upload) and answer like
their explicit-mask oracle (tests/model_runtime/oracles.py); `exact` ignores it; `schema` stays available."""

from __future__ import annotations

import httpx
import pytest
import torch

from promptcache.model_runtime.baseline import full_prefill_logits
from promptcache.model_runtime.engine import Fidelity, resolve
from promptcache.server.settings import ServerSettings
from tests.conftest import make_tiny_runtime
from tests.model_runtime.oracles import reuse_reference
from tests.model_runtime.test_fidelity import SCHEMA

PROMPT = '<prompt schema="lib"><user><d0/><d2/>Which documents mention time?</user><assistant/></prompt>'


@pytest.fixture
def server(live_server):
    return live_server(fidelity_context=ServerSettings.model_fields["fidelity_context"].default)


def _oracle_logprobs(fidelity: Fidelity) -> torch.Tensor:
    runtime = make_tiny_runtime("llama")
    runtime.add_schema(runtime.parse_schema(SCHEMA))
    plan = runtime.plan(PROMPT, add_generation_prompt=True)  # as the server parses it
    tokens, positions, mask = reuse_reference(plan, resolve(plan, fidelity))
    return torch.log_softmax(full_prefill_logits(runtime.loaded.model, tokens, positions, mask)[-1], -1)


def _first(server, **fields) -> tuple[dict, int, float]:
    body = httpx.post(server.url + "/v1/generate", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1, **fields}).json()
    logprobs = body["choices"][0]["logprobs"]
    return body["cache"], logprobs["token_ids"][0], logprobs["token_logprobs"][0]


def _explain(server, **fields) -> dict:
    return httpx.post(server.url + "/v1/prompts/explain", json={"prompt": PROMPT, **fields}).json()


def test_fast_and_balanced_reuse_second_encodings_by_default(server):
    assert ServerSettings.model_fields["fidelity_context"].default == "predecessor"
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    before = _explain(server, fidelity="fast")
    assert before["context"] == "predecessor"
    assert [(m["path"], m["tier"], m["encoded_after"]) for m in before["modules"]] == [
        ("d0", "device", None), ("d2", None, "d1")]  # d2's second encoding: not made at upload
    for mode, k in (("fast", None), ("balanced", 2)):
        fields = {"fidelity": mode, **({"fidelity_head_tokens": k} if k else {})}
        cache, token, logprob = _first(server, **fields)
        assert cache["context"] == "predecessor"
        assert [(m["path"], m["encoded_after"]) for m in cache["modules"]] == [("d0", None), ("d2", "d1")]
        preceded = _oracle_logprobs(Fidelity(mode, k or 16, "contiguous", "predecessor"))
        assert token == int(preceded.argmax()) and abs(logprob - preceded[token].item()) < 1e-4
        schema = _oracle_logprobs(Fidelity(mode, k or 16, "contiguous", "schema"))
        assert abs(logprob - schema[token].item()) > 1e-4  # the two encodings really differ here
    assert [m["tier"] for m in _explain(server, fidelity="fast")["modules"]] == ["device", "device"]

    cache, token, logprob = _first(server, fidelity="fast", fidelity_context="schema")  # still available
    assert cache["context"] == "schema" and [m["encoded_after"] for m in cache["modules"]] == [None, None]
    schema = _oracle_logprobs(Fidelity("fast", positions="contiguous"))
    assert token == int(schema.argmax()) and abs(logprob - schema[token].item()) < 1e-4
    cache, _, _ = _first(server, fidelity="exact")
    assert cache["context"] == "schema" and cache["exact"] is True  # exact ignores the context
