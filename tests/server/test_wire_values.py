"""Values a request or the model produces that the wire cannot carry as given: a chat text part whose `text` is
not a string (a 400 naming it), and logprobs that are not finite numbers (JSON has no -Infinity or NaN: one
representation, -9999.0, on every route, JSON and SSE), against a real server."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from promptcache.server.generation import UNLIKELY_LOGPROB
from tests.model_factories import make_tiny_loaded
from tests.server.test_api import PROMPT, SCHEMA

NUM_ALLOWED = 3  # tokens the model can produce; every other token has logit -inf (logprob -inf)
TOP = 6  # alternatives asked for: more than NUM_ALLOWED, so -inf ones are among them


def strict_json(text: str):
    """`text` as JSON, refusing what JSON does not have (NaN, Infinity, -Infinity)."""
    def refuse(constant: str):
        raise AssertionError(f"{constant} in a response body: not JSON")
    return json.loads(text, parse_constant=refuse)


def sse_payloads(response: httpx.Response) -> list:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [strict_json(line) for line in lines[:-1]]


def numbers_under(value, key_part: str, inside: bool = False) -> list[float]:
    """Every number held (at any depth) under a key containing `key_part`."""
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in numbers_under(v, key_part, inside or key_part in k)]
    if isinstance(value, list):
        return [n for item in value for n in numbers_under(item, key_part, inside)]
    return [value] if inside and isinstance(value, float) else []


def loader_ruling_out_tokens():
    """The tiny model with every output logit but NUM_ALLOWED tokens' set to -inf (a model ruling tokens out)."""
    loaded = make_tiny_loaded("llama")
    allowed = torch.tensor([loaded.tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "c")])
    assert len(allowed) == NUM_ALLOWED

    def rule_out(module, args, logits):
        masked = torch.full_like(logits, float("-inf"))
        masked[..., allowed] = logits[..., allowed]
        return masked

    loaded.model.get_output_embeddings().register_forward_hook(rule_out)
    return loaded


@pytest.fixture
def server(live_server):
    return live_server(loader=loader_ruling_out_tokens, logits_cache_bytes=0)


def test_every_route_sends_a_ruled_out_tokens_logprob_as_the_same_finite_number(server):
    url = server.url
    assert httpx.post(url + "/v1/schemas", json={"pml": SCHEMA}, timeout=60).status_code == 201
    native = {"prompt": PROMPT, "max_tokens": 3, "logprobs": TOP}
    chat = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 3, "logprobs": True, "top_logprobs": TOP}
    completion = {"prompt": "a b c", "max_tokens": 3, "logprobs": TOP}
    bodies = {}
    for name, path, body in (("generate", "/v1/generate", native), ("chat", "/v1/chat/completions", chat),
                             ("completions", "/v1/completions", completion)):
        response = httpx.post(url + path, json=body, timeout=60)
        assert response.status_code == 200, (name, response.text)  # OpenAI JSON refused -inf: a 500
        bodies[name] = [strict_json(response.text)]
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as streamed:
            streamed.read()
            bodies[name + " (SSE)"] = sse_payloads(streamed)  # both SSE routes sent -Infinity
    # Echo scores the prompt's tokens: ruled-out ones are the sampled position's own logprob, not an alternative.
    echoed = httpx.post(url + "/v1/completions", json={"prompt": "a zebra", "max_tokens": 0, "echo": True,
                                                       "logprobs": 1}, timeout=60)
    bodies["completions (echo)"] = [strict_json(echoed.text)]
    assert UNLIKELY_LOGPROB in bodies["completions (echo)"][0]["choices"][0]["logprobs"]["token_logprobs"]
    for name, payloads in bodies.items():
        values = numbers_under(payloads, "logprob")
        assert UNLIKELY_LOGPROB in values, name  # /v1/generate's JSON had null here
        assert all(v == UNLIKELY_LOGPROB or -100 < v <= 0 for v in values), name


def test_a_chat_text_part_whose_text_is_not_a_string_is_a_400_naming_it(live_server):
    server = live_server()
    for text in (3, None, ["a"], {"t": "a"}):
        for path, extra in (("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})):
            content = [{"type": "text", "text": "fine"}, {"type": "text", "text": text}]
            response = httpx.post(server.url + path, json={"messages": [{"role": "user", "content": content}],
                                                           **extra}, timeout=60)
            assert response.status_code == 400, (path, text, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request" and "messages[0].content[1].text: expected a string" in \
                error["message"]
