"""Occupancy: the positions a prompt already uses, as sorted disjoint intervals (placement in O(log n))."""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class Occupancy:
    """Used positions as sorted, disjoint, non-adjacent half-open intervals [start, end).

    Placing the text of a long prompt asks, per text piece, for the highest used position below some
    position and the first used position inside a range; with a set of positions both were linear,
    which made placement quadratic in the prompt's length.
    """

    def __init__(self, positions: Iterable[int] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for position in sorted(set(positions)):
            self.add(position, position + 1)

    def __bool__(self) -> bool:
        return bool(self._starts)

    def add(self, start: int, end: int) -> None:
        """Mark [start, end) used (it may touch or overlap used intervals)."""
        if start >= end:
            return
        i = bisect.bisect_left(self._ends, start)  # first interval that ends at or after start
        j = bisect.bisect_right(self._starts, end)  # intervals [i, j) touch or overlap [start, end)
        if i < j:
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]

    def highest(self) -> int | None:
        """The highest used position, or None."""
        return self._ends[-1] - 1 if self._ends else None

    def highest_below(self, limit: int) -> int | None:
        """The highest used position < limit, or None."""
        i = bisect.bisect_left(self._starts, limit) - 1  # last interval starting below limit
        return None if i < 0 else min(self._ends[i], limit) - 1

    def first_in(self, start: int, end: int) -> int | None:
        """The lowest used position in [start, end), or None."""
        i = bisect.bisect_right(self._ends, start)  # first interval ending after start
        if i == len(self._starts) or self._starts[i] >= end:
            return None
        return max(self._starts[i], start)
