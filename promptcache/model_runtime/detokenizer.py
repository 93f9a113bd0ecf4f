"""Incremental detokenization with stop strings: emits only text that can no longer change."""

from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    """Generated token ids as text deltas for one sequence. Text that ends in an incomplete UTF-8 character or a
    stop string's prefix is held back, so a delta is never taken back; a stop string cuts the text before it
    and sets `is_stopped`."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.text = ""       # final text so far (emitted + held back)
        self.num_emitted = 0  # characters of `text` already returned as deltas
        self.is_stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; returns the newly safe text (possibly empty)."""
        if self.is_stopped:
            return ""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        for stop in self.stop:
            at = text.find(stop, max(0, self.num_emitted - len(stop)))
            if at != -1:
                text, self.is_stopped = text[:at], True
        self.text = text
        if self.is_stopped:
            return self._emit(len(text))
        safe = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes as U+FFFD
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return self._emit(safe)

    def flush(self) -> str:
        """At the end of generation: everything not yet emitted."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        delta = self.text[self.num_emitted: upto]
        self.num_emitted = max(self.num_emitted, upto)
        return delta
