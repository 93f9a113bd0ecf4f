"""Parts of OpenAI response bodies: head, usage, the `promptcache` extension, and logprobs in chat's or completions'
legacy shape `{"tokens", "token_logprobs", "top_logprobs" (per position the N likeliest tokens and the sampled one),
"text_offset" (each token's character offset in the returned text)}`."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Sequence

from promptcache.model_runtime import RequestReport, TokenEvent, TokenLogprobs
from promptcache.server.generation import to_wire, wire_logprob

TokenText = Callable[[int], str]


def response_head(model_name: str, *, chat: bool) -> dict:
    """What an OpenAI response and each of its chunks start with: a new id, the object, the time, the model."""
    prefix, obj = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": obj, "created": int(time.time()), "model": model_name}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def report_usage(report: RequestReport) -> dict:
    u = report.usage
    assert u is not None, "a served request reports usage"
    return usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)


def extension(report: RequestReport) -> dict:
    """The `promptcache` object of OpenAI responses: /v1/generate's `cache` report plus the timings."""
    timings = report.timings
    assert timings is not None and report.cache is not None, "a served request reports timings and its cache"
    return {**to_wire(report.cache).model_dump(),
            "timings": {name: round(getattr(timings, name), 3) for name in ("ttft_ms", "total_ms", "lookup_ms")}}


def logprobs(events: list[TokenEvent], token_text: TokenText, chat: bool, text_offset: int = 0) -> dict:
    """One sample's token events (they must carry logprobs) in the chat or the legacy shape."""
    return chat_logprobs(events, token_text) if chat else completion_logprobs(events, token_text, text_offset)


def completion_logprobs(events: list[TokenEvent], token_text: TokenText, text_offset: int = 0) -> dict:
    """Legacy shape of one sample's token events (they must carry logprobs), the first at `text_offset`."""
    texts, values = [], []
    for event in events:
        assert event.logprobs is not None and event.token_id is not None
        texts.append(token_text(event.token_id))
        values.append(event.logprobs)
    return _legacy(texts, values, token_text, text_offset)


def prompt_logprobs(prompt_ids: list[int], prompt_logprobs: Sequence[TokenLogprobs], token_text: TokenText) -> dict:
    """Legacy shape of an echoed prompt's tokens: the first has no logprob (None), as OpenAI reports it.
    Built once per prompt; each of its samples appends its own tokens (`echoed_logprobs`)."""
    assert len(prompt_logprobs) == len(prompt_ids) - 1, "one logprob per prompt token after the first"
    return _legacy([token_text(t) for t in prompt_ids], [None, *prompt_logprobs], token_text, 0)


def echoed_logprobs(prompt: dict, generated: dict) -> dict:
    """The prompt's tokens then one sample's, the generated offsets shifted past the prompt's text."""
    shift = prompt["text_offset"][-1] + len(prompt["tokens"][-1])
    return {**{key: prompt[key] + generated[key] for key in prompt},
            "text_offset": prompt["text_offset"] + [shift + o for o in generated["text_offset"]]}


def _legacy(texts: list[str], logprobs: Sequence[TokenLogprobs | None], token_text: TokenText, offset: int) -> dict:
    """Legacy shape of tokens with these texts and logprobs (None: a token without), the first at `offset`."""
    return {"tokens": texts, "token_logprobs": [None if lp is None else wire_logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": [None if lp is None else _legacy_top(text, lp, token_text)
                             for text, lp in zip(texts, logprobs)],
            "text_offset": [offset + o for o in itertools.accumulate((len(t) for t in texts), initial=0)][:-1]}


def _legacy_top(text: str, logprobs: TokenLogprobs, token_text: TokenText) -> dict[str, float]:
    """The N most likely tokens by text, plus the token itself (as OpenAI's legacy shape has it)."""
    top = {token_text(t): wire_logprob(value) for t, value in logprobs.top}
    top.setdefault(text, wire_logprob(logprobs.logprob))
    return top


def chat_logprobs(events: list[TokenEvent], token_text: TokenText) -> dict:
    """One sample's token events (with logprobs) as `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`."""
    content = []
    for event in events:
        assert event.logprobs is not None and event.token_id is not None
        content.append({**_entry(token_text(event.token_id), event.logprobs.logprob),
                        "top_logprobs": [_entry(token_text(t), lp) for t, lp in event.logprobs.top]})
    return {"content": content, "refusal": None}


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": wire_logprob(logprob), "bytes": list(text.encode("utf-8"))}
