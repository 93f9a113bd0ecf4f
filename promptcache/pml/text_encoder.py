"""The tokenizer view PML needs: text -> token ids, chat markup, and sequence-start tokens."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from promptcache.pml.chat_format import PLAIN_CHAT_FORMAT, ChatFormat, chat_format_from_tokenizer
from promptcache.pml.errors import ChatTemplateError, PmlLimitError

# Characters in one text piece (PmlLimits.max_piece_chars), refused before tokenizing: one tokenizer call on a 2 MiB
# piece takes seconds of a worker (a whole long-context window is ~128K tokens, ~512K characters).
MAX_PIECE_CHARS = 1 << 19
CONTINUATION_SENTINEL = "\n"  # kept by every tokenizer's normalizer, merges with nothing after it


@dataclass(frozen=True, slots=True)
class TextEncoder:
    """Everything PML asks of a tokenizer; built once per model with `from_tokenizer`. `bos_token_ids`: the
    tokens every sequence starts with (Llama's `<s>`), and so does a schema's layout. PML tokenizes each text
    piece on its own. SentencePiece tokenizers (Llama-2, Mistral) prepend a "▁" to every encoded text, a space
    at every piece boundary: for those, `continuation_ids` holds the ids of a sentinel ("\n") a piece is
    encoded after (then cut off) unless the caller says it starts the sequence (`at_start`), so it tokenizes
    as it does inside the full text (docs/pml.md)."""

    encode_fn: Callable[[str], list[int]]
    chat_format: ChatFormat = PLAIN_CHAT_FORMAT
    bos_token_ids: tuple[int, ...] = ()
    placeholder_id: int = 0  # fills parameter slots while modules are encoded (the paper's <unk>)
    chat_format_error: str | None = None  # why role tags cannot be used (a template not split per role)
    continuation_ids: tuple[int, ...] | None = None  # sentinel ids; None: pieces tokenize alike anywhere
    max_piece_chars: int = MAX_PIECE_CHARS  # longer texts are refused before tokenizing
    _cache: _EncodeCache = field(default_factory=lambda: _EncodeCache(), repr=False, compare=False)

    def role_format(self, line: int | None = None) -> ChatFormat:
        """The per-role markup for role tags; ChatTemplateError naming the line when the model's chat template
        cannot be split per role."""
        if self.chat_format_error is not None:
            raise ChatTemplateError(f"role tags cannot be used with this model: {self.chat_format_error}; "
                                    "send the conversation through /v1/chat/completions without a schema", line=line)
        return self.chat_format

    def encode(self, text: str, *, at_start: bool = False) -> tuple[int, ...]:
        """Token ids of `text` with no special tokens added (special-token text is still recognised), as
        it tokenizes inside a longer text (or at the sequence start, `at_start`)."""
        if len(text) > self.max_piece_chars:
            raise PmlLimitError(f"a text of {len(text)} characters (starting {text[:24]!r}); the limit is "
                                f"{self.max_piece_chars} characters per text piece: split it across modules")
        sentinel = self.continuation_ids
        if sentinel is None or at_start or not text:
            return self._encode(text)
        ids = self._encode(CONTINUATION_SENTINEL + text)
        if ids[:len(sentinel)] == sentinel:
            return ids[len(sentinel):]
        return self._encode(text)  # the sentinel merged with the text: no clean cut, encode it alone

    def starts_alike(self, text: str, token_ids: tuple[int, ...]) -> bool:
        """Whether `token_ids` (`text` encoded inside a longer text) are also its encoding at the sequence start."""
        return self.continuation_ids is None or self.encode(text, at_start=True) == token_ids

    def _encode(self, text: str) -> tuple[int, ...]:
        if (cached := self._cache.get(text)) is None:
            cached = tuple(self.encode_fn(text))
            self._cache.put(text, cached)
        return cached

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, max_piece_chars: int = MAX_PIECE_CHARS) -> TextEncoder:
        """Wrap a Hugging Face tokenizer (duck-typed: PML does not import transformers)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)

        def encode_fn(text: str) -> list[int]:
            # A fast tokenizer's Rust backend directly: the same ids without the per-call Python overhead. Its
            # `encode_batch` releases the GIL while it works (`encode` keeps it: a 2 MiB text held every other
            # thread, the event loop included, for seconds).
            if backend is not None:
                return list(backend.encode_batch([text], add_special_tokens=False)[0].ids)
            return list(tokenizer.encode(text, add_special_tokens=False))

        with_special = list(tokenizer.encode("a", add_special_tokens=True))
        plain = list(tokenizer.encode("a", add_special_tokens=False))
        bos: tuple[int, ...] = ()
        if len(with_special) > len(plain) and with_special[-len(plain):] == plain:
            bos = tuple(with_special[: len(with_special) - len(plain)])
        unk = getattr(tokenizer, "unk_token_id", None)
        placeholder = unk if isinstance(unk, int) else (encode_fn(" ") or [0])[0]
        sentinel = tuple(encode_fn(CONTINUATION_SENTINEL))
        joined = tuple(encode_fn(CONTINUATION_SENTINEL + "a"))
        continuation = sentinel if joined[:len(sentinel)] == sentinel and \
            joined[len(sentinel):] != tuple(encode_fn("a")) else None
        try:
            chat_format, error = chat_format_from_tokenizer(tokenizer, adds_bos=bool(bos)), None
        except ChatTemplateError as exc:  # e.g. Llama-2-chat: the server still starts; role tags get a 4xx
            chat_format, error = PLAIN_CHAT_FORMAT, str(exc)
        return cls(encode_fn=encode_fn, chat_format=chat_format, bos_token_ids=bos, placeholder_id=placeholder,
                   chat_format_error=error, continuation_ids=continuation, max_piece_chars=max_piece_chars)


class _EncodeCache:
    """LRU of short texts' token ids, bounded in characters (requests must not grow it). Thread-safe."""

    MAX_TEXT_CHARS = 4096
    MAX_TOTAL_CHARS = 4 << 20

    def __init__(self) -> None:
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, text: str) -> tuple[int, ...] | None:
        with self._lock:
            if (ids := self._entries.get(text)) is not None:
                self._entries.move_to_end(text)
            return ids

    def put(self, text: str, ids: tuple[int, ...]) -> None:
        if len(text) > self.MAX_TEXT_CHARS:
            return
        with self._lock:
            if text in self._entries:
                return
            self._entries[text] = ids
            self._chars += len(text)
            while self._chars > self.MAX_TOTAL_CHARS:
                old, _ = self._entries.popitem(last=False)
                self._chars -= len(old)
