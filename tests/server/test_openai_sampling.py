"""Sampling fields over HTTP with the official openai client: penalties, logit_bias, min_p and
repetition_penalty (vLLM's extra_body names) reach the engine; bad values are refused naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from promptcache.model_runtime.prompt_tokens import completion_tokens
from tests.model_factories import make_test_tokenizer
from tests.server.test_openai import client  # noqa: F401  (fixture)

PROMPT = "The quick brown fox jumps over the lazy dog. The dog sleeps."


def _complete(api, **kwargs) -> str:
    return api.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, **kwargs).choices[0].text


def test_logit_bias_forces_a_token_and_penalties_change_greedy_output(client):  # noqa: F811
    api, _ = client
    plain = _complete(api)
    forced_id = completion_tokens(make_test_tokenizer(), " fox")[0]
    forced = api.completions.create(model="m", prompt=PROMPT, max_tokens=3, temperature=0,
                                    logit_bias={str(forced_id): 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [make_test_tokenizer().decode([forced_id])] * 3
    chat = api.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
                                       temperature=0, logit_bias={str(forced_id): 100})
    assert chat.choices[0].message.content == make_test_tokenizer().decode([forced_id] * 3)
    changed = [_complete(api, presence_penalty=2.0, frequency_penalty=2.0),
               _complete(api, extra_body={"repetition_penalty": 3.0}),
               _complete(api, extra_body={"min_p": 0.5, "repetition_penalty": 0.2})]
    assert any(text != plain for text in changed)  # the fields are applied, not ignored
    assert _complete(api, extra_body={"min_p": 0.5}) == plain  # min_p does not change greedy


def test_native_generate_takes_the_same_fields(client):  # noqa: F811
    _, server = client
    body = {"prompt": "<prompt schema=\"__nope__\"/>", "max_tokens": 2, "presence_penalty": 0.5}
    reply = httpx.post(server.url + "/v1/generate", json=body, timeout=60)
    assert reply.status_code == 404  # the fields validated; the (missing) schema is what fails


@pytest.mark.parametrize(("extra", "field"), [
    ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
])
def test_bad_values_are_refused_naming_the_field(client, extra, field):  # noqa: F811
    api, _ = client
    with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError), match=field):
        api.completions.create(model="m", prompt=PROMPT, max_tokens=2, **extra)
