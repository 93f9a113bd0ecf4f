"""A JSON request body's object read from a bounded prefix of it: the router keys each request by a few of its
fields on the gateway's event loop, so of a body of megabytes only the prefix is ever looked at."""

from __future__ import annotations

import codecs
import json
import re
from collections import deque
from typing import Any

MAX_DEPTH = 64  # nesting read; deeper prefixes are not read (no routed field is that deep)
# A JSON string, its closing quote in group 1 (absent when the prefix ends inside it). Linear: the loop's two branches
# start with different characters and nothing after it can fail, so the engine never backtracks into it.
_STRING = re.compile(r'"(?:[^"\\]+|\\.)*(")?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_CLOSERS = {"{": "}", "[": "]"}


def read_object(body: bytes, max_bytes: int) -> dict[str, Any] | None:
    """The JSON object `body` holds, read from its first `max_bytes` bytes: when they cut it, what they hold of it,
    closed where they end. A string value they cut is its start; a member or item they cut into otherwise (a number,
    a key) is left out, and so is everything after them. None if the body is no UTF-8 JSON object (as far as the
    prefix shows)."""
    is_whole = len(body) <= max_bytes
    try:  # utf-8-sig: a leading BOM is skipped, as json.loads does; a character cut at the end is dropped
        text = codecs.getincrementaldecoder("utf-8-sig")().decode(body[:max_bytes], final=is_whole)
    except UnicodeDecodeError:
        return None
    if is_whole:
        return _as_object(text)
    for candidate in _closings(text):
        if (value := _as_object(candidate)) is not None:
            return value
    return None


def _as_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _closings(text: str) -> list[str]:
    """Ways to close the cut JSON `text` into a whole one, the fullest first (json.loads judges them): the containers
    open at its end are closed, after the last string value (cut or whole) or before the member or item cut."""
    strings = deque(_STRING.finditer(text), maxlen=1)  # each string found in C; only the last one is kept
    last_string = strings[0] if strings else None
    stack = _open_brackets(_NOT_BRACKET.sub("", _STRING.sub("", text)))
    if not stack:  # no JSON (None), or an object closed before the end (the rest of the body is not looked at)
        return [] if stack is None else [text]
    closers = "".join(_CLOSERS[bracket] for bracket in reversed(stack))
    after_strings = 0 if last_string is None else last_string.end()
    bracket_at = max(text.rfind(bracket, after_strings) for bracket in "[]{}")
    if bracket_at >= 0:  # the last token is a bracket
        end = bracket_at + 1
        if text[bracket_at] in _CLOSERS:  # cut right after an opening: that container's items are cut
            candidates = [text[:end] + closers]
            if "," in text[end:]:  # items before the last comma are whole
                candidates.insert(0, text[:text.rindex(",")] + closers)
            return candidates
        return _after_value(text, end, closers, [])
    assert last_string is not None  # an open container's bracket precedes it
    before = text[:last_string.start()].rstrip()
    is_key = stack[-1] == "{" and before.endswith(("{", ","))
    if last_string.group(1) is None:  # the prefix ends inside this string
        if is_key:
            return [before.removesuffix(",") + closers]
        return [text[:len(text) - n] + '"' + closers for n in range(6)]  # less an escape cut short (`\`, `\u00`)
    return _after_value(text, last_string.end(), closers, [before.removesuffix(",") + closers] if is_key else [])


def _after_value(text: str, end: int, closers: str, fallback: list[str]) -> list[str]:
    """Closings of `text` whose last whole token ends at `end`: the text as it is when nothing but whitespace follows
    (a whole value), else up to the last comma (a scalar after it may be cut); `fallback` last."""
    tail = text[end:]
    candidates = [text + closers] if not tail.strip() else []
    if "," in tail:
        candidates.append(text[:end + tail.rindex(",")] + closers)
    return candidates + fallback


def _open_brackets(brackets: str) -> str | None:
    """The openings left unclosed in a sequence of brackets; None if they do not nest or nest past MAX_DEPTH."""
    for _ in range(MAX_DEPTH + 1):  # each pass removes the innermost pairs
        reduced = brackets.replace("[]", "").replace("{}", "")
        if reduced == brackets:
            break
        brackets = reduced
    else:
        return None
    if len(brackets) > MAX_DEPTH or "]" in brackets or "}" in brackets:
        return None
    return brackets
