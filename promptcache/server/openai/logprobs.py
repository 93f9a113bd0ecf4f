"""Token logprobs in OpenAI's two shapes, from the engine's per-token events.

Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` with `top_logprobs` a
dict per position of the N most likely tokens plus the sampled one, `text_offset` each token's character
offset in the returned text. Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
"refusal": None}`. Logprobs are of the model's distribution (before temperature, top-k, top-p).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from promptcache.model_runtime import TokenEvent, TokenLogprobs

TokenText = Callable[[int], str]


def completion_logprobs(events: list[TokenEvent], token_text: TokenText, *, text_offset: int = 0) -> dict:
    """Legacy completions shape for one sample's token events (they must carry logprobs), the first token at
    character `text_offset`."""
    texts, logprobs = [], []
    for event in events:
        assert event.logprobs is not None and event.token_id is not None
        texts.append(token_text(event.token_id))
        logprobs.append(event.logprobs)
    return _legacy(texts, logprobs, token_text, text_offset)


def prompt_logprobs(prompt_ids: list[int], prompt_logprobs: tuple[TokenLogprobs, ...] | list[TokenLogprobs],
                    token_text: TokenText) -> dict:
    """Legacy shape over an echoed prompt's tokens: the first has no logprob (None), as OpenAI reports it.
    Built once per prompt; each of its samples appends its own tokens (`echoed_logprobs`)."""
    assert len(prompt_logprobs) == len(prompt_ids) - 1, "one logprob per prompt token after the first"
    return _legacy([token_text(t) for t in prompt_ids], [None, *prompt_logprobs], token_text, 0)


def echoed_logprobs(prompt: dict, generated: dict) -> dict:
    """The prompt's tokens (`prompt_logprobs`) then one sample's generated ones (`completion_logprobs`),
    the generated offsets shifted past the prompt's text."""
    shift = prompt["text_offset"][-1] + len(prompt["tokens"][-1])
    return {**{key: prompt[key] + generated[key] for key in prompt},
            "text_offset": prompt["text_offset"] + [shift + o for o in generated["text_offset"]]}


def _legacy(texts: list[str], logprobs: Sequence[TokenLogprobs | None], token_text: TokenText, offset: int) -> dict:
    """Legacy shape of tokens with these texts and logprobs (None: a token without), the first at `offset`."""
    return {"tokens": texts, "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp is None else _legacy_top(text, lp, token_text)
                             for text, lp in zip(texts, logprobs)],
            "text_offset": [offset + o for o in itertools.accumulate((len(t) for t in texts), initial=0)][:-1]}


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
