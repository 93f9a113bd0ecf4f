"""The Detokenizer: generated token ids as streamed text deltas, at a cost per token that does not grow with the
output (a few tokens decoded per push, stop strings matched over the new characters only)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

# An incomplete UTF-8 character (a multi-byte character split across tokens) decodes to U+FFFD until its last byte.
REPLACEMENT = "\ufffd"
# A character's bytes span at most 4 tokens: past this many unread tokens whose text still ends in U+FFFD the model
# is emitting invalid bytes, and their replacement characters are taken as final rather than decoding an ever longer
# window (the streamed text differs from a full decode only if a later token would have completed the character).
MAX_PENDING_TOKENS = 8


class Detokenizer:
    """Generated token ids as text deltas, never taken back: text is held while it ends in a partial UTF-8 character
    or in a prefix of a stop string. The first stop string to be completed (of those completed by the same character,
    the longest) cuts the text at its start and sets `is_stopped`. The deltas concatenated with `flush()` are the
    decode of all the ids (special tokens skipped) cut there (with a SentencePiece tokenizer, for valid UTF-8: its
    byte fallback turns a whole run of byte pieces into U+FFFD when a later one is invalid).

    Each push decodes a window of the last few tokens, at most twice (Hugging Face TGI's and vLLM's prefix and read
    offsets): `_ids[:_num_read]` were read already and are context (a SentencePiece token's leading space depends on
    the token before it), `_ids[_num_read:]` are not; their text is the window's decode past the context's."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.is_stopped = False
        self._stops = StopScanner(self.stop)
        self._ids: list[int] = []  # the window: context, then tokens not yet read
        self._num_read = 0
        self._context_text = ""  # decode(_ids[:_num_read])
        self._num_taken = 0  # characters of the unread tokens' text already taken (those before a trailing U+FFFD)
        self._held = ""  # text taken but not emitted: a suffix that begins a stop string

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the newly safe text (possibly empty). Called once per token, in order."""
        if self.is_stopped:
            return ""
        self._ids.append(token_id)
        new_text = self._new_text()
        is_complete = bool(new_text) and not new_text.endswith(REPLACEMENT)
        if is_complete or len(self._ids) - self._num_read > MAX_PENDING_TOKENS:
            return self._take(self._read(new_text))
        # Characters before a trailing U+FFFD are final (later bytes complete only the last character).
        complete = new_text.rstrip(REPLACEMENT)
        taken = complete[self._num_taken:]
        self._num_taken = max(self._num_taken, len(complete))
        return self._take(taken)

    def flush(self) -> str:
        """At the end of generation: everything not yet emitted (a trailing partial character as U+FFFD), cut at a
        stop string completed by it."""
        if self.is_stopped:
            return ""
        delta = self._take(self._read(self._new_text()))
        if self.is_stopped:
            return delta
        delta, self._held = delta + self._held, ""
        return delta

    def _new_text(self) -> str:
        """The text of the unread tokens: the window's decode past the context's (empty if it is not longer)."""
        text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        return text[len(self._context_text):]

    def _read(self, new_text: str) -> str:
        """Mark every token read and return the part of `new_text` not taken yet; the tokens just read become the
        next window's context."""
        taken = new_text[self._num_taken:]
        self._ids = self._ids[self._num_read:]
        self._num_read = len(self._ids)
        self._context_text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        self._num_taken = 0
        return taken

    def _take(self, text: str) -> str:
        """Append final text: returns what is safe to emit (all but a suffix that may begin a stop string, or up to
        the start of the first stop string completed)."""
        if not text:
            return ""
        held = self._held + text
        start = self._stops.scan(text)
        if start is not None:
            # A stop string starting before `text` begins within the held characters (they are its prefix).
            cut = len(held) - len(text) + start
            assert cut >= 0, "a stop string began in text already emitted"
            self.is_stopped, self._held = True, ""
            return held[:cut]
        num_held = self._stops.num_held
        self._held = held[len(held) - num_held:] if num_held else ""
        return held[:len(held) - num_held]


class StopScanner:
    """Stop strings matched as text arrives, each with its Knuth-Morris-Pratt state: the length of the longest suffix of
    the text so far that is a prefix of it. Linear in the text fed, whatever the stop strings' lengths."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._tables = [_failure_table(stop) for stop in self.stops]
        self._states = [0] * len(self.stops)

    @property
    def num_held(self) -> int:
        """Characters at the end of the text that begin some stop string (and so may not be emitted yet)."""
        return max(self._states, default=0)

    def scan(self, text: str) -> int | None:
        """Feed `text`, which follows everything fed before. Returns where the first stop string completed in it
        starts, as an index into `text` (negative: that many characters before it, within the `num_held` last ones
        fed before), or None. Of the stop strings completed by the same character, the longest wins (it starts
        first). Once one is completed the scanner is spent."""
        first: tuple[int, int] | None = None  # (index of the completing character, -length)
        for i, stop in enumerate(self.stops):
            table, state, length = self._tables[i], self._states[i], len(stop)
            for end, char in enumerate(text):
                while state and stop[state] != char:
                    state = table[state - 1]
                if stop[state] == char:
                    state += 1
                    if state == length:
                        found = (end, -length)
                        first = found if first is None else min(first, found)
                        break
            self._states[i] = state
        return None if first is None else first[0] + 1 + first[1]


@functools.lru_cache(maxsize=256)
def _failure_table(stop: str) -> tuple[int, ...]:
    """`table[k]`: the length of the longest proper prefix of `stop[:k + 1]` that is also its suffix (KMP)."""
    table = [0] * len(stop)
    length = 0
    for k in range(1, len(stop)):
        while length and stop[k] != stop[length]:
            length = table[length - 1]
        if stop[k] == stop[length]:
            length += 1
        table[k] = length
    return tuple(table)
