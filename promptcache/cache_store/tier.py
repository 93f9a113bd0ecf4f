"""The interface every storage tier implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

from promptcache.cache_store.block import KVBlock


class Tier(ABC):
    """One level of the KV store with a byte budget.

    `put` returns the entries it evicted to make room, so the TieredStore can demote them to the
    next tier instead of losing them. `is_shared` tiers (Redis, disk) are visible to other processes.
    """

    name: str
    max_bytes: int
    is_shared: bool = False

    @abstractmethod
    def get(self, key: str) -> KVBlock | None: ...

    @abstractmethod
    def put(self, key: str, block: KVBlock, *, pinned: bool = False,
            ttl_s: float | None = None) -> list[tuple[str, KVBlock]]: ...

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def pin(self, key: str) -> bool: ...

    @abstractmethod
    def unpin(self, key: str) -> bool: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def keys(self) -> list[str]: ...
