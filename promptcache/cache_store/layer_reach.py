"""LayerReach: which of a block's tokens a request reads, per layer. A sliding-window layer reads only the keys some
query of the request can still reach (the block's tail); a full-attention layer reads every key. A fetch from a
shared tier reads only that part (block_format.py's ranged reads), and a block read that way records what it holds."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LayerReach:
    """Per layer, the first token of a block that is read (0: every token; the block's length: none of them), and the
    block's length where known (a hint for readers: blocks of one length share a layout)."""

    first_tokens: tuple[int, ...]
    num_tokens: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if any(t < 0 for t in self.first_tokens):
            raise ValueError(f"first tokens must be >= 0, got {self.first_tokens}")

    def covers(self, other: LayerReach | None) -> bool:
        """True if every token `other` reads is in this reach (None reads the whole block)."""
        if other is None:
            return not any(self.first_tokens)
        return len(other.first_tokens) == len(self.first_tokens) and \
            all(mine <= theirs for mine, theirs in zip(self.first_tokens, other.first_tokens))

    def union(self, other: LayerReach) -> LayerReach:
        """What either reach reads."""
        return LayerReach(tuple(map(min, self.first_tokens, other.first_tokens)), self.num_tokens)

    @property
    def is_whole(self) -> bool:
        return not any(self.first_tokens)

    def share_of(self, nbytes: int, num_tokens: int) -> int:
        """The bytes of `nbytes` of a `num_tokens` block's KV that this reach reads."""
        return nbytes * self.num_read(num_tokens) // max(1, len(self.first_tokens) * num_tokens)

    def num_read(self, num_tokens: int) -> int:
        """How many (layer, token) pairs of a `num_tokens` block are read: the block's bytes times this / (layers x
        tokens) are fetched."""
        if max(self.first_tokens, default=0) <= num_tokens:  # as window_reach makes them: sums in C
            return len(self.first_tokens) * num_tokens - sum(self.first_tokens)
        return sum(num_tokens - min(t, num_tokens) for t in self.first_tokens)


def window_reach(windows: Sequence[int | None], position_ids: Sequence[int], first_query: int,
                 shift: int = 0) -> LayerReach | None:
    """What a request whose first query lies at position `first_query` reads of a block at `position_ids` (moved by
    `shift` for it): on a layer with window W, a key at position k is read only if first_query - (k + shift) < W
    (later queries lie further on, decode included); None when every layer reads the whole block. Positions that are
    not ascending keep from the first token in reach on: a block is read as one tail per layer."""
    distinct = _distinct_windows(tuple(windows))
    if not distinct or not position_ids:
        return None
    ascending = isinstance(position_ids, range) and position_ids.step > 0
    lo, hi = (position_ids[0], position_ids[-1]) if ascending else (min(position_ids), max(position_ids))
    first_token: dict[int | None, int] = {None: 0}
    for window in distinct:
        lowest = first_query - window + 1 - shift  # the lowest stored position this layer reads
        first_token[window] = 0 if lo >= lowest else len(position_ids) if hi < lowest else \
            bisect.bisect_left(position_ids, lowest) if ascending else \
            next(i for i, p in enumerate(position_ids) if p >= lowest)
    if not any(first_token.values()):
        return None
    return LayerReach(tuple(map(first_token.__getitem__, windows)), len(position_ids))


@functools.lru_cache(maxsize=64)
def _distinct_windows(windows: tuple[int | None, ...]) -> tuple[int, ...]:
    return tuple(sorted({w for w in windows if w is not None}))
