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
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens  # its logits cached too


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
    # A repeat: all reused.
    assert usage.completion_tokens == 6 and usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens


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
    with pytest.raises(openai.BadRequestError, match="suffix"):
        api.completions.create(model="m", prompt="x", max_tokens=2, suffix="end")
    with pytest.raises(openai.UnprocessableEntityError, match="logprobs"):
        api.completions.create(model="m", prompt="x", max_tokens=2, logprobs=21)
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
    ({"store": True}, "store"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),  # a vLLM extension we do not implement
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
    ({"suffix": "end"}, "suffix"), ({"best_of": 2}, "best_of"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"), ({"extra_body": {"top_a": 0.1}}, "top_a"),
])
def test_unimplemented_or_unknown_completion_fields_are_400_naming_the_field(client, kwargs, field):
    api, _ = client
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(model="tiny-llama", prompt="Hi", max_tokens=2, **kwargs)
    assert raised.value.status_code == 400 and field in raised.value.message


def _greedy_oracle(server, prompt_ids: list[int], steps: int, top: int):
    """Greedy decoding with the server's model run directly (full forward each step): per step the token
    id, its logprob and the top-`top` (id, logprob) pairs."""
    import torch

    model = server.app.state.service.runtime.model.loaded.model
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            token = int(logprobs.argmax())
            values, indices = torch.topk(logprobs, top)
            out.append((token, float(logprobs[token]), list(zip(indices.tolist(), values.tolist()))))
            ids.append(token)
    return out


def test_completion_logprobs_match_the_model_streamed_or_not(client):
    api, server = client
    import httpx

    prompt = "The quick brown fox"
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    oracle = _greedy_oracle(server, prompt_ids, 4, 3)
    text_of = server.app.state.service.token_strings.text
    completion = api.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
    lp = completion.choices[0].logprobs
    assert lp.tokens == [text_of(t) for t, _, _ in oracle]
    assert lp.token_logprobs == pytest.approx([p for _, p, _ in oracle], abs=1e-4)
    for got, (token, _, top) in zip(lp.top_logprobs, oracle):
        assert set(got) == {text_of(t) for t, _ in top} | {text_of(token)}
        assert got[text_of(top[0][0])] == pytest.approx(top[0][1], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    streamed = [c.choices[0].logprobs for c in api.completions.create(
        model="m", prompt=prompt, max_tokens=4, temperature=0, logprobs=3, stream=True) if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_chat_logprobs_and_top_logprobs(client):
    api, server = client
    import httpx

    messages = [{"role": "user", "content": "Hi there"}]
    prompt_ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    oracle = _greedy_oracle(server, prompt_ids, 3, 2)
    chat = api.chat.completions.create(model="m", messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = chat.choices[0].logprobs.content
    text_of = server.app.state.service.token_strings.text
    assert [c.token for c in content] == [text_of(t) for t, _, _ in oracle]
    assert [c.logprob for c in content] == pytest.approx([p for _, p, _ in oracle], abs=1e-4)
    assert [[a.token for a in c.top_logprobs] for c in content] == [[text_of(t) for t, _ in top] for *_, top in oracle]
    assert content[0].bytes == list(content[0].token.encode())
    plain = api.chat.completions.create(model="m", messages=messages, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        api.chat.completions.create(model="m", messages=messages, max_tokens=3, top_logprobs=2)


def test_several_prompts_and_token_id_prompts_each_get_their_choices(client):
    api, server = client
    import httpx

    texts = ["The quick brown fox", "Once upon a time", "The quick brown dog"]
    alone = [api.completions.create(model="m", prompt=t, max_tokens=4, temperature=0).choices[0].text for t in texts]
    batch = api.completions.create(model="m", prompt=texts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [t for t in alone for _ in range(2)]
    assert batch.usage.completion_tokens == 3 * 2 * 4
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    assert api.completions.create(model="m", prompt=ids[0], max_tokens=4, temperature=0).choices[0].text == alone[0]
    by_ids = api.completions.create(model="m", prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == alone
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)


def test_echo_returns_the_prompt_before_the_completion(client):
    api, server = client
    import httpx

    prompt = "The quick brown fox"
    plain = api.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0).choices[0].text
    echoed = api.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain
    only = api.completions.create(model="m", prompt=[prompt, "Hi"], max_tokens=0, echo=True)
    assert [c.text for c in only.choices] == [prompt, "Hi"] and only.usage.completion_tokens == 0
    count = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["count"]
    assert api.completions.create(model="m", prompt=prompt, max_tokens=0, echo=True).usage.prompt_tokens == count


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"echo": True, "stream": True}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": ["a", "b"], "stream": True}, "prompt"),
    ({"prompt": [10**9]}, "token id"),
    ({"prompt": []}, "prompt"),
])
def test_completion_prompt_forms_refused_with_400_naming_the_problem(client, kwargs, field):
    api, _ = client
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(**{"model": "m", "prompt": "Hi", "max_tokens": 2, **kwargs})
    assert field in raised.value.message


def test_echo_with_logprobs_scores_every_prompt_token_like_the_model(client):
    """What lm-evaluation-harness's loglikelihood requests send: token ids, echo, logprobs, max_tokens 0."""
    import torch

    api, server = client
    import httpx

    text = "The quick brown fox jumps over the lazy dog"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    model, text_of = server.app.state.service.runtime.model.loaded.model, server.app.state.service.token_strings.text
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, vocab]
    oracle = [float(expected[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    api.completions.create(model="m", prompt=text, max_tokens=2, temperature=0)  # its prefix is now cached
    for prompt in (ids, text):
        scored = api.completions.create(model="m", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
        lp = scored.choices[0].logprobs
        assert lp.tokens == [text_of(t) for t in ids] and lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(oracle, abs=1e-4)
        best = int(expected[0].argmax())
        assert lp.top_logprobs[1][text_of(best)] == pytest.approx(float(expected[0, best]), abs=1e-4)
        assert scored.usage.completion_tokens == 0 and scored.choices[0].text == text
    more = api.completions.create(model="m", prompt=ids, max_tokens=2, echo=True, logprobs=0, temperature=0)
    lp = more.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[1:len(ids)] == pytest.approx(oracle, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)
    with pytest.raises(openai.BadRequestError, match="echo"):
        api.completions.create(model="m", prompt='<prompt schema="docs"><user>Hi</user></prompt>', max_tokens=0,
                               echo=True, logprobs=1)


def test_the_async_client_streams_chat_with_logprobs(client):
    import asyncio

    _, server = client

    async def run():
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Hi there"}]
        whole = await api.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0,
                                                  logprobs=True, top_logprobs=1)
        stream = await api.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0,
                                                   logprobs=True, top_logprobs=1, stream=True)
        pieces = [c async for c in stream]
        await api.close()
        return whole, pieces

    whole, pieces = asyncio.run(run())
    streamed = [e for c in pieces if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole.choices[0].logprobs.content])
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == whole.choices[0].message.content
