"""KVView: which stored KV a shared block is (a range of a stored block, its keys maybe shifted)."""

from __future__ import annotations

from typing import NamedTuple


class KVView(NamedTuple):
    """Which KV a shared block is: tokens [first, last) of the block stored under `key` (`last` None: to
    its end), its keys moved by `shift` positions when attended (rope_shift.py; the stored block is never
    changed). A view that is not whole is a distinct tensor, held and counted under its store key."""

    key: str
    first: int = 0
    last: int | None = None
    shift: int = 0

    @property
    def is_whole(self) -> bool:
        return self.first == 0 and self.last is None and self.shift == 0

    def order(self) -> tuple[str, int, bool, int, int]:
        """A total order of views (for sorting): one to the block's end before any range ending earlier."""
        return self.key, self.first, self.last is not None, self.last or 0, self.shift
