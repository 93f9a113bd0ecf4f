"""The Detokenizer against a full decode of all the ids cut at the first stop string, over the real tokenizers
(SmolLM2's, the byte-level test tokenizer, the three SentencePiece setups); its work per token against the
output's length and the stop strings' length."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from promptcache.model_runtime.detokenizer import MAX_PENDING_TOKENS, Detokenizer
from promptcache.model_runtime.loading.default_model import default_model_path
from tests.model_factories import make_test_tokenizer
from tests.sentencepiece_model import CORPUS, TOKENIZER_KINDS, sentencepiece_loaded

BYTE_LEVEL = ("smollm2", "test")
# The corpus's characters plus some that only byte fallback (SentencePiece) or several byte tokens encode.
ALPHABET = "".join(sorted(set(CORPUS))) + "€日本😀🎉ß"
LONG_TEXT = (CORPUS + "Emoji 😀 and 🎉, yen ¥, 日本語のテキスト, € 5.\n") * 40


@functools.cache
def tokenizer(name: str):
    """A tokenizer as the server loads it: SmolLM2's (the default model's), the test tokenizer, or a SentencePiece
    kind from tests/sentencepiece_model.py."""
    if name == "smollm2":
        return PreTrainedTokenizerFast.from_pretrained(str(default_model_path()))
    if name == "test":
        return make_test_tokenizer()
    return sentencepiece_loaded(name).tokenizer


@functools.cache
def non_byte_ids(name: str) -> tuple[int, ...]:
    """A SentencePiece vocabulary without its byte-fallback pieces (`<0x41>`...)."""
    pieces = tokenizer(name).convert_ids_to_tokens(list(range(len(tokenizer(name)))))
    return tuple(i for i, piece in enumerate(pieces) if not (piece.startswith("<0x") and piece.endswith(">")))


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` cut at the start of the stop string that ends first (of those ending at the same character, the
    longest): the one a stream read a character at a time meets first. With whether one was found."""
    found = [(text.find(stop) + len(stop), -len(stop)) for stop in stops if stop in text]
    if not found:
        return text, False
    end, minus_length = min(found)
    return text[:end + minus_length], True


def stream(detokenizer: Detokenizer, ids: list[int]) -> list[str]:
    """The deltas of pushing `ids` until a stop string, then the flush."""
    deltas = []
    for token_id in ids:
        deltas.append(detokenizer.push(token_id))
        if detokenizer.is_stopped:
            break
    return [*deltas, detokenizer.flush()]


@st.composite
def token_ids(draw, name: str) -> list[int]:
    """Any ids for a byte-level tokenizer (special tokens and partial UTF-8 characters included). For SentencePiece,
    whose byte-fallback decoder replaces a whole run of byte pieces when one is invalid (no stream can match a full
    decode of random bytes), an encoded text or ids without byte pieces."""
    if name in BYTE_LEVEL:
        return draw(st.lists(st.integers(0, len(tokenizer(name)) - 1), max_size=48))
    if draw(st.booleans()):
        text = draw(st.text(alphabet=ALPHABET, max_size=80))
        return tokenizer(name).encode(text, add_special_tokens=False)
    return draw(st.lists(st.sampled_from(non_byte_ids(name)), max_size=48))


@pytest.mark.parametrize("name", [*BYTE_LEVEL, *TOKENIZER_KINDS])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_stream_is_the_full_decode_cut_at_the_first_stop_string(name, data):
    """Deltas + flush == decode(all ids) cut at the first stop string: no delta is ever taken back or missing, and
    stop strings are found across token boundaries and multi-byte characters."""
    ids = data.draw(token_ids(name), label="ids")
    text = tokenizer(name).decode(ids, skip_special_tokens=True)
    spans = data.draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 8)), max_size=3), label="spans")
    stops = [text[start % len(text):][:length] for start, length in spans] if text else []
    stops += data.draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=1), label="others")
    detokenizer = Detokenizer(tokenizer(name), stops)
    streamed = "".join(stream(detokenizer, ids))
    assert (streamed, detokenizer.is_stopped) == reference(text, stops)


class CountingTokenizer:
    """A tokenizer recording how many ids each `decode` call is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_ids_decoded: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.num_ids_decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_each_token_decodes_a_window_of_the_last_few_tokens_however_long_the_output():
    """4,096 tokens of text with multi-byte characters: at most two decodes per token, each of at most
    2 x (MAX_PENDING_TOKENS + 1) ids (a full decode per token grows with the output)."""
    ids = tokenizer("smollm2").encode(LONG_TEXT, add_special_tokens=False)[:4096]
    assert len(ids) == 4096
    counting = CountingTokenizer(tokenizer("smollm2"))
    streamed = "".join(stream(Detokenizer(counting, ()), ids))
    assert streamed == tokenizer("smollm2").decode(ids)
    assert len(counting.num_ids_decoded) <= 2 * len(ids) + 2
    assert max(counting.num_ids_decoded) <= 2 * (MAX_PENDING_TOKENS + 1)


class CountingStop(str):
    """A stop string counting the characters and slices read from it."""

    num_reads = 0

    def __getitem__(self, key):
        CountingStop.num_reads += 1
        return super().__getitem__(key)


def test_stop_string_work_per_character_does_not_grow_with_the_stop_strings_length():
    """8 stop strings of 256 characters that never match: at most 4 reads of each per character streamed
    (checking every prefix of every stop string at each token reads each ~256 times)."""
    stops = [CountingStop((f"{i} never said " * 30)[:256]) for i in range(8)]
    ids = tokenizer("smollm2").encode(LONG_TEXT, add_special_tokens=False)[:1024]
    detokenizer = Detokenizer(tokenizer("smollm2"), stops)
    CountingStop.num_reads = 0
    streamed = "".join(stream(detokenizer, ids))
    assert not detokenizer.is_stopped and streamed == tokenizer("smollm2").decode(ids)
    assert CountingStop.num_reads <= 4 * len(stops) * len(streamed)


def test_a_stream_of_invalid_bytes_is_emitted_without_an_ever_longer_window():
    """A token that is one invalid UTF-8 byte, 300 times: 300 U+FFFD as the full decode has them, each decode
    bounded (the text never ends in a complete character)."""
    test_tokenizer = tokenizer("test")
    byte_id = next(i for i in range(len(test_tokenizer)) if test_tokenizer.decode([i]) == "\ufffd")
    counting = CountingTokenizer(test_tokenizer)
    deltas = stream(Detokenizer(counting, ()), [byte_id] * 300)
    assert "".join(deltas) == test_tokenizer.decode([byte_id] * 300) == "\ufffd" * 300
    assert max(counting.num_ids_decoded) <= 2 * (MAX_PENDING_TOKENS + 1)


def test_partial_stop_strings_are_held_back():
    ids = tokenizer("test").encode("the sky is blue and the dog runs", add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer("test"), stop=("dog",))
    deltas = stream(detokenizer, ids)
    assert detokenizer.is_stopped and "".join(deltas) == "the sky is blue and the "
    assert "d" not in "".join(deltas[:-2]).split("and the")[-1]  # "d..." was never streamed early


def test_a_stop_strings_prefix_is_held_across_a_character_split_into_tokens():
    """The stop string "T😀": "T" stays held while 😀's bytes arrive over several tokens (emitting it when the text
    ended in a partial character leaked it)."""
    smollm2 = tokenizer("smollm2")
    ids = smollm2.encode("ld€T😀 f", add_special_tokens=False)
    assert any(smollm2.decode([i]).endswith("\ufffd") for i in ids)  # 😀 is split
    detokenizer = Detokenizer(smollm2, stop=("T😀",))
    assert "".join(stream(detokenizer, ids)) == "ld€" and detokenizer.is_stopped


def test_the_stop_string_completed_first_wins():
    """Stops "abcde" and "bc" over "xabcdef": "bc" ends first, whatever the order or the tokens; of two ending
    together ("bc", "abc"), the longer."""
    test_tokenizer = tokenizer("test")
    ids = test_tokenizer.encode("xabcdef", add_special_tokens=False)
    for stops, expected in [(("abcde", "bc"), "xa"), (("bc", "abcde"), "xa"), (("bc", "abc"), "x")]:
        assert "".join(stream(Detokenizer(test_tokenizer, stops), ids)) == expected
