"""The store interface the runtime needs (cache_store.TieredStore implements it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Protocol

from promptcache.cache_store import FetchPolicy, KVBlock, Tier


class KVStore(Protocol):
    policy: FetchPolicy  # decides whether fetching from a shared tier beats recomputing

    def get(self, key: str, *, num_tokens: int | None = None,
            nbytes: int | None = None, promote: bool = True) -> tuple[KVBlock, str] | None: ...

    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
            kind: Literal["module", "prefix"] = "module", owner: str | None = None, local: bool = True) -> None: ...

    def tier_of(self, key: str) -> Tier | None: ...

    def touch(self, keys: Iterable[str]) -> None: ...

    def delete(self, key: str) -> bool: ...

    def acquire(self, keys: Iterable[str]) -> None: ...

    def release(self, keys: Iterable[str]) -> None: ...
