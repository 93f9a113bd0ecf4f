"""The official openai package against our OpenAI-compatible endpoints, unchanged."""

from __future__ import annotations

import openai
import pytest

from tests.server.test_api import SCHEMA


@pytest.fixture
def client(live_server):
    server = live_server()
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60), server


def test_models_and_plain_completion(client):
    api, _ = client
    assert [m.id for m in api.models.list().data] == ["tiny-llama"]
    completion = api.completions.create(model="tiny-llama", prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens_details.cached_tokens == 0  # the first request: nothing stored yet
    again = api.completions.create(model="tiny-llama", prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert again.choices[0].text == completion.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_completion_with_pml_prompt_reports_cached_tokens(client):
    api, server = client
    import httpx

    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    completion = api.completions.create(
        model="tiny-llama", prompt='<prompt schema="docs"><user><d1/>Who sleeps?</user><assistant/></prompt>',
        max_tokens=4, temperature=0)
    assert completion.usage.prompt_tokens_details.cached_tokens > 0
    assert completion.model_extra["promptcache"]["modules"][0]["path"] == "d1"


def test_streaming_completion_equals_non_streaming(client):
    api, _ = client
    full = api.completions.create(model="m", prompt="Cats sleep", max_tokens=6, temperature=0).choices[0].text
    stream = api.completions.create(model="m", prompt="Cats sleep", max_tokens=6, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    usage = chunks[-1].usage
    assert usage.completion_tokens == 6 and usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_chat_plain_and_with_schema_modules(client):
    api, server = client
    import httpx

    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    plain = api.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi <there> & you"}],
                                        max_tokens=4, temperature=0)
    assert plain.choices[0].message.role == "assistant" and plain.usage.prompt_tokens_details.cached_tokens == 0
    with_docs = api.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "<d1/><d2/>Who sleeps?"}], max_tokens=4, temperature=0,
        extra_body={"schema": "docs"})
    assert with_docs.usage.prompt_tokens_details.cached_tokens > 0
    assert with_docs.model_extra["promptcache"]["exact"] is True
    streamed = api.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "<d1/><d2/>Who sleeps?"}], max_tokens=4, temperature=0,
        extra_body={"schema": "docs"}, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == with_docs.choices[0].message.content


def test_openai_errors_map_to_sdk_exceptions(client):
    api, _ = client
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        api.completions.create(model="m", prompt="x", max_tokens=2, logprobs=2)
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="m", messages=[{"role": "user", "content": "<d1/>"}],
                                    extra_body={"schema": "missing"})


def test_neutral_values_of_unimplemented_fields_are_accepted(client):
    api, _ = client
    chat = api.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0,
        tool_choice="none", response_format={"type": "text"}, user="u-1", metadata={"k": "v"}, store=False,
        modalities=["text"], service_tier="auto", logprobs=False)
    assert chat.choices[0].message.role == "assistant"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"store": True}, "store"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"extra_body": {"min_p": 0.1}}, "min_p"),            # a vLLM extension we do not implement
    ({"extra_body": {"surprise": 1}}, "surprise"),        # a field nobody defines
    ({"messages": [{"role": "user", "content": "Hi", "name": "bob"}]}, "name"),
])
def test_unimplemented_or_unknown_chat_fields_are_400_naming_the_field(client, kwargs, field):
    api, _ = client
    request = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(**request)
    assert raised.value.status_code == 400 and field in raised.value.message


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"echo": True}, "echo"), ({"suffix": "end"}, "suffix"), ({"best_of": 2}, "best_of"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
])
def test_unimplemented_or_unknown_completion_fields_are_400_naming_the_field(client, kwargs, field):
    api, _ = client
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(model="tiny-llama", prompt="Hi", max_tokens=2, **kwargs)
    assert raised.value.status_code == 400 and field in raised.value.message
