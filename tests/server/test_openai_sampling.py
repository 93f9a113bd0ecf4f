"""Sampling fields over HTTP with the official openai client: penalties, logit_bias, min_p and
repetition_penalty (vLLM's extra_body names) reach the engine and give what `model.generate` gives with
the same settings on the same tiny model; bad values are refused naming the field."""

from __future__ import annotations

import httpx
import openai
import torch
from transformers import LogitsProcessorList

from promptcache.model_runtime.engine import Fidelity, resolve
from tests.conftest import make_tiny_runtime
from tests.model_factories import make_test_tokenizer
from tests.model_runtime.test_sampling_processors import OpenAIPenalties, RepetitionAfter
from tests.server.test_api import SCHEMA
from tests.server.test_openai import client  # noqa: F401  (fixture)

TEXT = "The quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs and the fox jumps again."
MAX_TOKENS = 8
PML_PROMPT = '<prompt schema="docs"><user><d1/><d2/>What do cats do?</user><assistant/></prompt>'


@torch.inference_mode()
def _hf_greedy(ids: list[int], **hf_kwargs) -> list[int]:
    """The oracle: transformers' own greedy generation on the weights the server loaded."""
    model = make_tiny_runtime("llama").loaded.model
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=0,
                         **hf_kwargs)
    return out[0, len(ids):].tolist()


def _texts(ids: list[int]) -> list[str]:
    """Each token's text decoded alone: how logprobs name tokens."""
    tokenizer = make_test_tokenizer()
    return [tokenizer.decode([t]) for t in ids]


def test_completion_fields_give_what_hf_generate_gives(client):  # noqa: F811
    api, _ = client
    ids = make_test_tokenizer().encode(TEXT, add_special_tokens=False)
    forced = ids[2]

    def tokens(**kwargs) -> list[str]:
        reply = api.completions.create(model="m", prompt=ids, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True, **kwargs.pop("extra_body", {})}, **kwargs)
        return reply.choices[0].logprobs.tokens

    plain = _hf_greedy(ids)
    assert tokens() == _texts(plain)
    cases = [
        (dict(logit_bias={str(forced): 100}), dict(sequence_bias={(forced,): 100.0})),
        (dict(logit_bias={str(ids[4]): 3.5, str(plain[0]): -20}), dict(sequence_bias={(ids[4],): 3.5,
                                                                                         (plain[0],): -20.0})),
        (dict(presence_penalty=1.5, frequency_penalty=0.8),
         dict(logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), 1.5, 0.8)]))),
        (dict(extra_body={"repetition_penalty": 1.8}), dict(repetition_penalty=1.8)),
        (dict(extra_body={"repetition_penalty": 1.8, "min_p": 0.5}), dict(repetition_penalty=1.8)),  # greedy
    ]
    for kwargs, hf_kwargs in cases:
        want = _hf_greedy(ids, **hf_kwargs)
        assert want != plain, kwargs  # the oracle says the field matters here
        assert tokens(**kwargs) == _texts(want), kwargs
    assert tokens(logit_bias={str(forced): 100}) == _texts([forced] * MAX_TOKENS)


def test_min_p_is_applied_when_sampling(client):  # noqa: F811
    api, _ = client
    ids = make_test_tokenizer().encode(TEXT, add_special_tokens=False)

    def text(**extra) -> str:
        return api.completions.create(model="m", prompt=ids, max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
                                      extra_body={"ignore_eos": True, **extra}).choices[0].text

    greedy = make_test_tokenizer().decode(_hf_greedy(ids))
    assert text() != greedy  # a free draw wanders off the argmax ...
    assert text(min_p=0.3) == text(min_p=0.3)  # ... seeded draws repeat ...
    assert text(min_p=1.0) == greedy  # ... and min_p = 1 leaves only the most likely token


def test_chat_fields_give_what_hf_generate_gives(client):  # noqa: F811
    api, server = client
    messages = [{"role": "user", "content": TEXT}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    bias = make_test_tokenizer().encode(" fox", add_special_tokens=False)[0]
    reply = api.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                        logprobs=True, logit_bias={str(bias): 4}, presence_penalty=-0.5,
                                        frequency_penalty=1.2,
                                        extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    want = _hf_greedy(ids, sequence_bias={(bias,): 4.0}, repetition_penalty=1.3,
                      logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), -0.5, 1.2)]))
    assert want != _hf_greedy(ids)
    assert [entry.token for entry in reply.choices[0].logprobs.content] == _texts(want)


def test_native_generate_penalizes_the_whole_prompt_reused_modules_included(client):  # noqa: F811
    _, server = client
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    runtime = make_tiny_runtime("llama")  # the same tokenizer and parser: the server's plan, in process
    runtime.add_schema(runtime.parse_schema(SCHEMA), encode=False)
    plan = runtime.plan(PML_PROMPT)
    ids = plan.token_ids()
    num_reused = len(ids) - len(resolve(plan, Fidelity("exact")).token_ids)  # exact: HF is the oracle
    bias = ids[-3]
    body = {"prompt": PML_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "fidelity": "exact", "repetition_penalty": 2.5, "logit_bias": {str(bias): 2.0}}
    reply = httpx.post(server.url + "/v1/generate", json=body, timeout=60).json()
    assert reply["usage"]["cached_tokens"] == num_reused > 0
    want = _hf_greedy(ids, repetition_penalty=2.5, sequence_bias={(bias,): 2.0})
    assert want != _hf_greedy(ids, sequence_bias={(bias,): 2.0})
    # penalizing only the computed tokens would give something else for this prompt
    assert want != _hf_greedy(ids, sequence_bias={(bias,): 2.0},
                              logits_processor=LogitsProcessorList([RepetitionAfter(num_reused, 2.5)]))
    assert reply["choices"][0]["logprobs"]["token_ids"] == want


def test_bad_values_are_refused_naming_the_field(client):  # noqa: F811
    api, server = client
    vocab = len(make_test_tokenizer())
    cases = [  # schema violations are 422 (as for every field); an id outside the vocabulary is a 400
        ({"extra_body": {"min_p": 2}}, "min_p", 422),
        ({"extra_body": {"min_p": -0.5}}, "min_p", 422),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", 422),
        ({"presence_penalty": 3}, "presence_penalty", 422),
        ({"frequency_penalty": -2.5}, "frequency_penalty", 422),
        ({"logit_bias": {"abc": 1}}, "logit_bias", 422),
        ({"logit_bias": {"-3": 1}}, "logit_bias", 422),
        ({"logit_bias": {"5": 500}}, "logit_bias", 422),
        ({"logit_bias": {str(vocab): 1}}, "logit_bias", 400),
        ({"logit_bias": {"999999999999": 1}}, "logit_bias", 400),
    ]
    for kwargs, field, status in cases:
        for create, extra in ((api.completions.create, {"prompt": TEXT}),
                              (api.chat.completions.create, {"messages": [{"role": "user", "content": TEXT}]})):
            try:
                create(model="m", max_tokens=2, **extra, **kwargs)
            except openai.APIStatusError as exc:
                assert exc.status_code == status and field in exc.body["message"], (kwargs, exc.body)
            else:
                raise AssertionError(f"{kwargs} was accepted")
    httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).raise_for_status()
    for body, field, status in [({"logit_bias": {str(vocab): 1}, "min_p": 0.1}, "logit_bias", 400),
                                ({"repetition_penalty": -1}, "repetition_penalty", 422),
                                ({"min_p": 1.5}, "min_p", 422)]:
        native = httpx.post(server.url + "/v1/generate", json={"prompt": PML_PROMPT, **body})
        assert native.status_code == status and field in native.json()["error"]["message"], native.text
