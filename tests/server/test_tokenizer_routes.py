"""/tokenize and /detokenize (vLLM's shapes) against the real server: the ids are what the completion routes
feed the model (their usage counts are the oracle), and detokenizing gives the text back."""

from __future__ import annotations

import httpx


def test_tokenize_counts_what_completions_feed_and_detokenize_inverts_it(live_server):
    server = live_server()
    text = "The quick brown fox\r\njumps."
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    completion = httpx.post(server.url + "/v1/completions", json={"prompt": text, "max_tokens": 1}).json()
    assert tokens["count"] == len(tokens["tokens"]) == completion["usage"]["prompt_tokens"]
    assert len(tokens["token_strs"]) == tokens["count"]
    models = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert tokens["max_model_len"] == models["max_model_len"] > 0
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert back.endswith(text)  # a tokenizer that adds BOS decodes it first


def test_tokenize_messages_counts_what_chat_feeds(live_server):
    server = live_server()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert tokens["count"] == chat["usage"]["prompt_tokens"]


def test_tokenizer_routes_refuse_what_they_cannot_do(live_server):
    server = live_server()
    cases = [({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
             ({"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
             ({"prompt": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens")]
    for body, needle in cases:
        response = httpx.post(server.url + "/tokenize", json=body)
        assert response.status_code == 400 and needle in response.json()["error"]["message"], response.text
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
