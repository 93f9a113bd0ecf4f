"""KV memory accounting for the running batch: own buffers plus shared blocks counted once."""

from __future__ import annotations


class KVMemory:
    """Tracks bytes reserved against a budget. Shared blocks are reference-counted by key."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.own_bytes = 0
        self.shared: dict[str, list[int]] = {}  # key -> [nbytes, refcount]

    @property
    def used_bytes(self) -> int:
        return self.own_bytes + sum(entry[0] for entry in self.shared.values())

    def cost(self, own_bytes: int, shared: dict[str, int]) -> int:
        """Bytes a new request would add: its own KV and the shared blocks not yet resident."""
        return own_bytes + sum(n for key, n in shared.items() if key not in self.shared)

    def fits(self, own_bytes: int, shared: dict[str, int]) -> bool:
        return self.used_bytes + self.cost(own_bytes, shared) <= self.max_bytes

    def reserve(self, own_bytes: int, shared: dict[str, int]) -> None:
        self.own_bytes += own_bytes
        for key, nbytes in shared.items():
            entry = self.shared.setdefault(key, [nbytes, 0])
            entry[1] += 1
        assert self.used_bytes <= self.max_bytes, "KV budget exceeded"

    def release(self, own_bytes: int, shared: dict[str, int]) -> None:
        self.own_bytes -= own_bytes
        for key in shared:
            entry = self.shared[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self.shared[key]
        assert self.own_bytes >= 0
