"""TokenStrings: every token id's text as logprobs, echo and /tokenize report it, built once per tokenizer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence


class TokenStrings:
    """id -> the token decoded alone (special tokens included), as OpenAI's logprobs report it: a table built once (on
    first use, under a lock) so per-token work runs no tokenizer; ids past the vocabulary are decoded directly."""

    def __init__(self, decode: Callable[[list[int]], str], vocab_size: int) -> None:
        self._decode = decode
        self._vocab_size = vocab_size
        self._table: list[str] | None = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer) -> TokenStrings:
        """The table of a Hugging Face tokenizer (every id `len(tokenizer)` counts, added tokens included)."""
        return cls(tokenizer.decode, len(tokenizer))

    @property
    def is_built(self) -> bool:
        return self._table is not None

    def build(self) -> Sequence[str]:
        """The whole table, decoding every id the first time (~0.1 s for 49K ids): off the loop, or `await ready()`."""
        if self._table is None:
            with self._lock:
                if self._table is None:
                    self._table = [self._decode([token_id]) for token_id in range(self._vocab_size)]
        return self._table

    async def ready(self) -> TokenStrings:
        """This table, built in a worker thread if need be: await it before looking up a stream's tokens on the loop."""
        if self._table is None:
            await asyncio.to_thread(self.build)
        return self

    def text(self, token_id: int) -> str:
        """One token's text (builds the table on first use)."""
        table = self.build()
        return table[token_id] if 0 <= token_id < len(table) else self._decode([token_id])
