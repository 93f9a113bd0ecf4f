"""RecentEncodings against the encoder itself (the oracle): the same ids, kept within the size budget, LRU order."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from promptcache.model_runtime.recent_encodings import RecentEncodings


class Counting:
    """An encoder that counts its calls: a code point a token."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, text: str) -> tuple[int, ...]:
        self.calls.append(text)
        if "\ud800" in text:
            raise ValueError("a lone surrogate")
        return tuple(ord(c) for c in text)


def test_a_repeat_returns_the_encoding_without_encoding_again():
    encode = Counting()
    recent = RecentEncodings[str](encode, len, max_size=100)
    assert recent("hello") == encode("hello")  # the oracle (its second call)
    assert recent("hello") == tuple(ord(c) for c in "hello")
    assert encode.calls == ["hello", "hello"]  # ours once, the oracle's once; the repeat none


def test_least_recently_used_texts_are_dropped_past_the_budget():
    encode = Counting()
    recent = RecentEncodings[str](encode, len, max_size=10)
    recent("aaaa")
    recent("bbbb")
    recent("aaaa")          # a is now the most recent
    recent("cccc")          # 12 characters: b, the least recent, goes
    assert len(recent) == 2
    encode.calls.clear()
    recent("aaaa")
    recent("cccc")
    assert encode.calls == []
    recent("bbbb")
    assert encode.calls == ["bbbb"]


def test_a_text_over_the_budget_is_encoded_but_never_kept():
    encode = Counting()
    recent = RecentEncodings[str](encode, len, max_size=3)
    assert recent("long text") == tuple(ord(c) for c in "long text")
    assert len(recent) == 0
    recent("long text")
    assert encode.calls == ["long text", "long text"]


def test_a_refused_text_raises_each_time_and_is_not_kept():
    encode = Counting()
    recent = RecentEncodings[str](encode, len, max_size=100)
    for _ in range(2):
        with pytest.raises(ValueError):
            recent("bad \ud800")
    assert len(recent) == 0 and len(encode.calls) == 2


def test_threads_get_the_encoder_s_ids():
    recent = RecentEncodings[str](Counting(), len, max_size=40)
    texts = [f"text {i % 7}" for i in range(200)]
    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(recent, texts))
    assert found == [tuple(ord(c) for c in t) for t in texts]
    assert sum(size for _, size in recent._entries.values()) == recent._held <= 40
