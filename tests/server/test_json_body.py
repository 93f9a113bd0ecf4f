"""Bodies encoded a slice at a time are byte for byte what FastAPI renders for the same value returned from a
route: JSONResponse after jsonable_encoder for plain data, the response model's serializer for models."""

from __future__ import annotations

import asyncio
import enum
import random

import pytest
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from fastapi.routing import serialize_response
from fastapi.utils import create_model_field

from promptcache.server import json_body
from promptcache.server.wire import (
    CacheReport,
    Choice,
    GenerateResponse,
    Logprobs,
    PromptSpanReport,
    Timings,
    Usage,
)


class Tier(str, enum.Enum):
    DEVICE = "device"


class Mode(enum.Enum):
    FAST = "fast"


def _logprobs(rng: random.Random, num_tokens: int, num_top: int) -> dict:
    words = ["é", "\"q\"", "\\", "🍵", " the", "\ufffd", "\n", "</s>", "x" * 3]
    tokens = [rng.choice(words) for _ in range(num_tokens)]
    return {"tokens": tokens, "token_logprobs": [None, *(-rng.random() * 1e-5 for _ in tokens[1:])],
            "top_logprobs": [None, *({rng.choice(words): -rng.random() * 20 for _ in range(num_top)}
                                     for _ in tokens[1:])],
            "text_offset": list(range(num_tokens))}


@pytest.mark.parametrize("num_tokens", [0, 1, 255, 256, 257, 1000])
def test_plain_data_is_encoded_as_json_response_encodes_it(num_tokens, monkeypatch):
    monkeypatch.setattr(json_body, "SLICE_ITEMS", 7)  # many slices, partial last ones
    rng = random.Random(num_tokens)
    value = {"id": "cmpl-1", "object": "text_completion", "created": 17, "model": "m\u00e9",
             "choices": [{"index": i, "text": "a\"b", "finish_reason": None, "logprobs": _logprobs(rng, num_tokens, 3)}
                         for i in range(3)] + [{"index": 3, "text": "", "finish_reason": "length", "logprobs": None}],
             "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}},
             "promptcache": {"prompts": [{"fidelity": Mode.FAST, "tier": Tier.DEVICE, "pair": (1, 2.5),
                                          "modules": [], "prefix": None, "ids": [[1, 2], [3]]}]},
             "tokens": list(range(num_tokens)), "empty": {}, "nothing": [], "numbers": {1: "int key"}}
    assert json_body.json_body(value) == JSONResponse(jsonable_encoder(value)).body


def test_a_model_is_encoded_as_its_response_model_serializes_it():
    rng = random.Random(0)
    lp = _logprobs(rng, 300, 5)
    choices = [Choice(index=i, text="tea \u00e9", finish_reason="length", logprobs=Logprobs(
        tokens=lp["tokens"], token_logprobs=[-1e-5, *lp["token_logprobs"][1:]], token_ids=list(range(300)),
        top_logprobs=[{}, *lp["top_logprobs"][1:]], top_token_ids=[[1, 2]] * 300, top_token_logprobs=[[-0.5]] * 300))
        for i in range(3)]
    for spans in (None, [PromptSpanReport(start=0, num_tokens=2, origin="computed", text='"choices":[]')]):
        response = GenerateResponse(
            id="gen-1", model='"choices":[]', choices=choices,
            usage=Usage(prompt_tokens=2, cached_tokens=0, completion_tokens=300, total_tokens=302),
            cache=CacheReport(exact=True, modules=[], spans=spans), timings=Timings(ttft_ms=1.5, total_ms=2.25))
        field = create_model_field(name="Response_generate", type_=GenerateResponse, mode="serialization")
        expected = asyncio.run(serialize_response(field=field, response_content=response, dump_json=True))
        assert json_body.model_body(response, "choices") == expected
