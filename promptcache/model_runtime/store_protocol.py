"""The store interface the runtime needs (cache_store.TieredStore implements it)."""

from __future__ import annotations

from typing import Protocol

from promptcache.cache_store import KVBlock


class KVStore(Protocol):
    def get(self, key: str, *, num_tokens: int | None = None,
            nbytes: int | None = None) -> tuple[KVBlock, str] | None: ...

    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None) -> None: ...

    def contains(self, key: str) -> str | None: ...
