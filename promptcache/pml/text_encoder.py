"""The tokenizer view PML needs: text -> token ids, chat markup, and sequence-start tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from promptcache.pml.chat_format import PLAIN_CHAT_FORMAT, ChatFormat, chat_format_from_tokenizer


@dataclass(frozen=True, slots=True)
class TextEncoder:
    """Everything PML asks of a tokenizer; built once per model with `from_tokenizer`.

    `bos_token_ids` are the tokens the tokenizer puts at the start of every sequence (Llama's `<s>`;
    none for GPT-2/ChatML models); a schema's layout starts with them.
    """

    encode_fn: Callable[[str], list[int]]
    chat_format: ChatFormat = PLAIN_CHAT_FORMAT
    bos_token_ids: tuple[int, ...] = ()
    placeholder_id: int = 0  # fills parameter slots while modules are encoded (the paper's <unk>)
    _cache: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of `text` with no special tokens added (special-token text is still recognised)."""
        cached = self._cache.get(text)
        if cached is None:
            cached = tuple(self.encode_fn(text))
            if len(self._cache) < 4096:
                self._cache[text] = cached
        return cached

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TextEncoder:
        """Wrap a Hugging Face tokenizer (duck-typed: PML does not import transformers)."""

        def encode_fn(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        with_special = list(tokenizer.encode("a", add_special_tokens=True))
        plain = list(tokenizer.encode("a", add_special_tokens=False))
        bos: tuple[int, ...] = ()
        if len(with_special) > len(plain) and with_special[-len(plain):] == plain:
            bos = tuple(with_special[: len(with_special) - len(plain)])
        unk = getattr(tokenizer, "unk_token_id", None)
        placeholder = unk if isinstance(unk, int) else (encode_fn(" ") or [0])[0]
        return cls(encode_fn=encode_fn, chat_format=chat_format_from_tokenizer(tokenizer, adds_bos=bool(bos)),
                   bos_token_ids=bos, placeholder_id=placeholder)
