"""Token logprobs in OpenAI's two shapes, from the engine's per-token events.

Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` with `top_logprobs` a
dict per position of the N most likely tokens plus the sampled one, `text_offset` each token's character
offset in the returned text. Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
"refusal": None}`. Logprobs are of the model's distribution (before temperature, top-k, top-p).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from promptcache.model_runtime import TokenEvent, TokenLogprobs

TokenText = Callable[[int], str]


def completion_logprobs(events: list[TokenEvent], token_text: TokenText, *, text_offset: int = 0) -> dict:
    """Legacy completions shape for one sample's token events (they must carry logprobs)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for event in events:
        assert event.logprobs is not None and event.token_id is not None
        text = token_text(event.token_id)
        tokens.append(text)
        token_logprobs.append(event.logprobs.logprob)
        top_logprobs.append(_legacy_top(text, event.logprobs, token_text))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def prompt_logprobs(prompt_ids: list[int], prompt_logprobs: tuple[TokenLogprobs, ...] | list[TokenLogprobs],
                    token_text: TokenText) -> dict:
    """Legacy shape over an echoed prompt's tokens: the first has no logprob (None), as OpenAI reports it.
    Built once per prompt; each of its samples appends its own tokens (`echoed_logprobs`)."""
    assert len(prompt_logprobs) == len(prompt_ids) - 1, "one logprob per prompt token after the first"
    tokens = [token_text(t) for t in prompt_ids]
    token_logprobs: list[float | None] = [None] + [lp.logprob for lp in prompt_logprobs]
    top_logprobs: list[dict | None] = [None, *(_legacy_top(text, lp, token_text)
                                               for text, lp in zip(tokens[1:], prompt_logprobs))]
    offsets = [0, *itertools.accumulate(len(t) for t in tokens[:-1])]
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def echoed_logprobs(prompt: dict, generated: dict) -> dict:
    """The prompt's tokens (`prompt_logprobs`) then one sample's generated ones (`completion_logprobs`),
    the generated offsets shifted past the prompt's text."""
    shift = prompt["text_offset"][-1] + len(prompt["tokens"][-1])
    return {"tokens": prompt["tokens"] + generated["tokens"],
            "token_logprobs": prompt["token_logprobs"] + generated["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + generated["top_logprobs"],
            "text_offset": prompt["text_offset"] + [shift + o for o in generated["text_offset"]]}


def _legacy_top(text: str, logprobs: TokenLogprobs, token_text: TokenText) -> dict[str, float]:
    """The N most likely tokens by text, plus the token itself (as OpenAI's legacy shape has it)."""
    top = {token_text(t): value for t, value in logprobs.top}
    top.setdefault(text, logprobs.logprob)
    return top


def chat_logprobs(events: list[TokenEvent], token_text: TokenText) -> dict:
    """Chat shape for one sample's token events (they must carry logprobs)."""
    content = []
    for event in events:
        assert event.logprobs is not None and event.token_id is not None
        content.append({**_entry(token_text(event.token_id), event.logprobs.logprob),
                        "top_logprobs": [_entry(token_text(t), lp) for t, lp in event.logprobs.top]})
    return {"content": content, "refusal": None}


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
