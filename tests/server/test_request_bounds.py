"""Bounded work per request, over HTTP with the official openai client: the prompt-count cap, chat message
cap, rate limits counted in prompts x n, echo + logprobs against the model and the tokenizer decoding each
token alone, and the event loop answering /health while a large echo + logprobs answer is assembled."""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys

import httpx
import openai
import pytest
import torch

from promptcache.server.openai.wire import MAX_CHAT_MESSAGES

KEYS = {"keys": {"sk-r": "rho", "sk-s": "sigma"},
        "quotas": {"rho": {"rate_limit": "10/minute"}, "sigma": {"rate_limit": "10/minute"}}}


def _api(server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_more_prompts_than_the_cap_is_a_400_naming_cap_and_count(live_server):
    server = live_server(max_prompts_per_request=4)
    api = _api(server)
    assert len(api.completions.create(model="m", prompt=["Hi"] * 4, max_tokens=1).choices) == 4
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(model="m", prompt=["Hi"] * 5, max_tokens=1)
    assert "5 prompts" in raised.value.message and "at most 4" in raised.value.message
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        api.completions.create(model="m", prompt=[[5, 6]] * 5, max_tokens=1)  # token-id lists count alike


def test_more_chat_messages_than_the_cap_is_a_422_naming_it(live_server):
    server = live_server()
    messages = [{"role": "user", "content": "hi"}] * (MAX_CHAT_MESSAGES + 1)
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        _api(server).chat.completions.create(model="m", messages=messages, max_tokens=1)
    assert f"messages: Value error, at most {MAX_CHAT_MESSAGES} items, got {MAX_CHAT_MESSAGES + 1}" in \
        raised.value.message
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": messages})
    assert tokenized.status_code == 422 and f"at most {MAX_CHAT_MESSAGES}" in tokenized.json()["error"]["message"]


def test_rate_limits_count_prompts_times_n(live_server, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    server = live_server(api_keys_file=str(keys_file))
    rho = _api(server, "sk-r")
    assert len(rho.completions.create(model="m", prompt=["a", "b", "c", "d", "e"], n=2, max_tokens=1).choices) == 10
    with pytest.raises(openai.RateLimitError) as limited:  # the window's 10 samples are spent
        rho.completions.create(model="m", prompt="a", max_tokens=1)
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60
    sigma = _api(server, "sk-s")
    with pytest.raises(openai.BadRequestError) as too_big:  # 12 samples never fit a window of 10
        sigma.completions.create(model="m", prompt=["a"] * 6, n=2, max_tokens=1)
    assert "12 samples" in too_big.value.message and "10/minute" in too_big.value.message
    # The refused request cost one hit (the guard's), not its 12: 1 + 3 x 3 fills the window exactly.
    assert len(sigma.completions.create(model="m", prompt=["a", "b", "c"], n=3, max_tokens=1).choices) == 9
    with pytest.raises(openai.RateLimitError):
        sigma.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)


def _scored(model, ids: list[int], num_top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each token after the first: its logprob given the tokens before, and the top `num_top` (id, logprob)."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, vocab]
    rows = []
    for i in range(1, len(ids)):
        values, indices = torch.topk(logprobs[i - 1], num_top)
        rows.append((float(logprobs[i - 1, ids[i]]), list(zip(indices.tolist(), values.tolist()))))
    return rows


def test_echo_with_logprobs_is_the_model_and_each_token_decoded_alone(live_server):
    server = live_server()
    loaded = server.app.state.service.runtime.model.loaded
    for prompts in (["The quick brown fox", "Once upon a time there was"], [[17, 260, 301, 44, 99, 5], [300, 7, 8]]):
        _check_echo_with_logprobs(server, loaded, prompts)


def _check_echo_with_logprobs(server, loaded, prompts: list) -> None:
    decode = loaded.tokenizer.decode
    reply = _api(server).completions.create(model="m", prompt=prompts, n=2, max_tokens=2, echo=True, logprobs=3,
                                            temperature=0)
    assert len(reply.choices) == 2 * len(prompts)
    for p, prompt in enumerate(prompts):
        ids = prompt if isinstance(prompt, list) else list(server.app.state.service.runtime.tokenize(prompt))
        echo = prompt if isinstance(prompt, str) else decode(ids)
        every = [*ids, *_greedy(loaded.model, ids, 2)]
        oracle = _scored(loaded.model, every, 3)
        for choice in reply.choices[2 * p: 2 * p + 2]:  # greedy: both samples are the same tokens
            lp = choice.logprobs
            assert choice.text == echo + decode(every[len(ids):])
            assert lp.tokens == [decode([t]) for t in every]
            assert lp.text_offset == [sum(len(decode([t])) for t in every[:i]) for i in range(len(every))]
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert lp.token_logprobs[1:] == pytest.approx([value for value, _ in oracle], abs=1e-4)
            for got, (value, top), token in zip(lp.top_logprobs[1:], oracle, every[1:]):
                expected = {decode([t]): v for t, v in top}
                expected.setdefault(decode([token]), value)
                assert set(got) == set(expected)
                assert [got[k] for k in expected] == pytest.approx(list(expected.values()), abs=1e-4)


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def test_health_answers_while_a_large_echo_with_logprobs_answer_is_built(live_server):
    """16 prompts x 1,800 tokens, n=2, 5 alternatives: ~350K token strings and a ~10 MB answer, all assembled
    and rendered in a worker thread while the event loop keeps answering."""
    server = live_server(max_request_bytes=4 << 20)
    rng = random.Random(0)
    vocab = len(server.app.state.service.runtime.model.loaded.tokenizer)
    prompts = [[rng.randrange(vocab) for _ in range(1800)] for _ in range(16)]
    body = {"prompt": prompts, "n": 2, "echo": True, "logprobs": 5, "max_tokens": 0}
    gc.collect()
    gc.freeze()  # as test_robustness: the bound measures the server, not a collection over the suite's heap
    try:
        poller = subprocess.Popen([sys.executable, "-m", "tests.server.health_poller", server.url],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert poller.stdout.readline().strip() == "ready"
        try:
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
        finally:
            out, _ = poller.communicate("stop\n", timeout=30)
    finally:
        gc.unfreeze()
    assert response.status_code == 200, response.text[:500]
    choices = response.json()["choices"]
    assert len(choices) == 32 and all(len(c["logprobs"]["tokens"]) == 1800 for c in choices)
    latencies = sorted(json.loads(out))
    assert len(latencies) >= 10
    assert latencies[int(0.95 * len(latencies))] < 0.1 and latencies[-1] < 0.5
