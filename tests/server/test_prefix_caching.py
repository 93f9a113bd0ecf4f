"""Automatic prefix reuse over HTTP: the official openai client, the native API, a real Redis, two replicas."""

from __future__ import annotations

import httpx
import openai
import pytest

from promptcache.model_runtime.facade import chat_tokens, completion_tokens
from tests.model_factories import make_test_tokenizer, make_tiny_loaded
from tests.server.test_api import SCHEMA

DOCUMENT = ("The quick brown fox jumps over the lazy dog. Cats sleep most of the day, and tea is brewed with "
            "hot water. Rome was not built in a day. The river flows north through the valley. ") * 4


def _api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _prompt_tokens(text: str) -> int:
    return len(completion_tokens(make_test_tokenizer(), text))


def test_repeat_and_shared_prefix_hit_with_identical_answers(live_server):
    api = _api(live_server(prefix_block_size=16))
    cold = api.completions.create(model="m", prompt=DOCUMENT + "Who sleeps?", max_tokens=6, temperature=0)
    again = api.completions.create(model="m", prompt=DOCUMENT + "Who sleeps?", max_tokens=6, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].text == cold.choices[0].text
    # Every token: the stored blocks cover the prompt and its last token's logits are cached, so the
    # repeat runs no forward pass before its first token.
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert again.model_extra["promptcache"]["prefix"]["tiers"] == {"device": again.usage.prompt_tokens}
    assert again.model_extra["promptcache"]["exact"] is True
    other = api.completions.create(model="m", prompt=DOCUMENT + "Where does the river flow?", max_tokens=6,
                                   temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens >= _prompt_tokens(DOCUMENT) - 1


def test_without_the_logits_cache_a_repeat_computes_its_last_token(live_server):
    api = _api(live_server(prefix_block_size=16, logits_cache_bytes=0))
    cold = api.completions.create(model="m", prompt=DOCUMENT + "Who sleeps?", max_tokens=6, temperature=0)
    again = api.completions.create(model="m", prompt=DOCUMENT + "Who sleeps?", max_tokens=6, temperature=0)
    assert again.choices[0].text == cold.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_multi_turn_chat_reuses_history_including_replies(live_server):
    api = _api(live_server(prefix_block_size=8))
    messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Who sleeps?"}]
    previous_prompt = 0
    for turn in range(3):
        reply = api.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
        usage = reply.usage
        assert usage.prompt_tokens == len(chat_tokens(make_test_tokenizer(), messages))
        if turn == 0:
            assert usage.prompt_tokens_details.cached_tokens == 0
        else:  # the whole previous prompt at least (the reply too, unless re-tokenizing it differs)
            assert usage.prompt_tokens_details.cached_tokens >= previous_prompt
        previous_prompt = usage.prompt_tokens
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And question {turn}?"}]


def test_streamed_usage_and_n_samples_report_reuse(live_server):
    api = _api(live_server(prefix_block_size=16))
    api.completions.create(model="m", prompt=DOCUMENT, max_tokens=2, temperature=0)
    chunks = list(api.completions.create(model="m", prompt=DOCUMENT, max_tokens=4, temperature=0, n=2, stream=True,
                                         stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    assert texts[0] == texts[1]  # greedy samples of one prompt agree


def test_text_reaches_the_tokenizer_unchanged(live_server):
    server = live_server()
    api = _api(server)
    text = "line one\r\nline\ttwo\x01\x7f <b>not a tag</b> &amp; <prompt"
    done = api.completions.create(model="m", prompt=text, max_tokens=2, temperature=0)
    assert done.usage.prompt_tokens == _prompt_tokens(text)
    content = "<d1/> is not an import here; \r\n & <user> neither"
    messages = [{"role": "user", "content": content}]
    chat = api.chat.completions.create(model="m", messages=messages, max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens == len(chat_tokens(make_test_tokenizer(), messages))


def test_chat_with_a_schema_accepts_a_system_message(live_server):
    server = live_server()
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    reply = _api(server).chat.completions.create(
        model="m", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<d1/>Who?"}],
        max_tokens=3, temperature=0, extra_body={"schema": "docs"})
    assert reply.usage.prompt_tokens_details.cached_tokens > 0


def test_pml_question_reused_and_explained(live_server):
    server = live_server(prefix_block_size=8)
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    prompt = f'<prompt schema="docs"><user><d1/>{DOCUMENT}Who sleeps?</user><assistant/></prompt>'
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = httpx.post(server.url + "/v1/generate", json=body, timeout=60).json()
    explained = httpx.post(server.url + "/v1/prompts/explain", json={"prompt": prompt}).json()
    second = httpx.post(server.url + "/v1/generate", json=body, timeout=60).json()
    assert first["cache"]["prefix"] is None and second["choices"] == first["choices"]
    new_tokens = first["usage"]["computed_tokens"]
    assert second["cache"]["prefix"]["num_tokens"] == new_tokens
    assert second["usage"]["cached_tokens"] == first["usage"]["cached_tokens"] + new_tokens
    assert second["usage"]["computed_tokens"] == 0
    assert explained["prefix"]["num_tokens"] == new_tokens and explained["tokens_to_compute"] == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert ('promptcache:reused_prompt_tokens_total{kind="prefix",model_name="tiny-llama",tenant="_default",'
            'tier="device"}') in metrics


def test_cache_salt_isolates_and_switch_turns_reuse_off(live_server):
    api = _api(live_server(prefix_block_size=16))
    for salt, expect_hit in [("a", False), ("b", False), ("a", True)]:
        done = api.completions.create(model="m", prompt=DOCUMENT, max_tokens=2, temperature=0,
                                      extra_body={"cache_salt": salt})
        assert (done.usage.prompt_tokens_details.cached_tokens > 0) is expect_hit, salt
    off = _api(live_server(prefix_caching=False))
    for _ in range(2):
        done = off.completions.create(model="m", prompt=DOCUMENT, max_tokens=2, temperature=0)
        assert done.usage.prompt_tokens_details.cached_tokens == 0  # reuse is off: nothing may be reused


@pytest.mark.timeout(120)
def test_second_replica_reuses_prefix_through_redis(live_server, redis_server):
    first = live_server(redis_url=redis_server.url, prefix_block_size=16)
    second = live_server(lambda: make_tiny_loaded("llama"), redis_url=redis_server.url, prefix_block_size=16)
    cold = _api(first).completions.create(model="m", prompt=DOCUMENT, max_tokens=4, temperature=0)
    assert first.app.state.service.store.flush(timeout_s=30)
    hit = _api(second).completions.create(model="m", prompt=DOCUMENT, max_tokens=4, temperature=0)
    assert hit.choices[0].text == cold.choices[0].text
    tiers = hit.model_extra["promptcache"]["prefix"]["tiers"]
    # Full blocks are found by key on the shared tier; only this replica's local map knows partial ones.
    full = (hit.usage.prompt_tokens - 1) // 16 * 16
    assert tiers.get("redis", 0) >= full > 0
