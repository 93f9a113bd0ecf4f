"""TieredStore: device -> host -> shared (Redis / disk) with promotion on hit, demotion on eviction."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.errors import CapacityError
from promptcache.cache_store.fetch_policy import FetchPolicy
from promptcache.cache_store.tier import Tier


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    hits: int
    misses: int
    evictions: int
    demotions: int
    promotions: int
    used_bytes: int
    max_bytes: int
    num_entries: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: tuple[TierStats, ...]
    num_gets: int
    num_puts: int


@dataclass(slots=True)
class _Counters:
    per_tier: dict[str, TierCounters] = field(default_factory=dict)
    gets: int = 0
    puts: int = 0


class TieredStore:
    """KV blocks in tiers ordered fastest first. Thread-safe (one lock around each operation).

    `get` looks tier by tier, returns the block on the first tier's device and the name of the tier it
    was found in, and promotes it to the faster tiers. `put` writes to the first tier (evictions are
    demoted down the chain, what falls off the last tier is dropped) and, with `write_through_shared`,
    to every shared tier too, so other replicas see it at once.
    """

    def __init__(self, tiers: Sequence[Tier], *, write_through_shared: bool = True,
                 policy: FetchPolicy | None = None) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.write_through_shared = write_through_shared
        self.policy = policy or FetchPolicy()
        self._lock = threading.RLock()
        self._counters = _Counters({t.name: TierCounters() for t in self.tiers})

    def get(self, key: str, *, num_tokens: int | None = None, nbytes: int | None = None) -> tuple[KVBlock, str] | None:
        """`num_tokens`/`nbytes` (optional) let the fetch policy skip a shared tier that would be slower
        than recomputing the block."""
        with self._lock:
            self._counters.gets += 1
            for index, tier in enumerate(self.tiers):
                counters = self._counters.per_tier[tier.name]
                if tier.is_shared and nbytes is not None and not self.policy.worth_fetching(tier.name, nbytes,
                                                                                              num_tokens):
                    counters.misses += 1
                    continue
                started = time.perf_counter()
                block = tier.get(key)
                if block is not None and tier.is_shared:
                    self.policy.record_fetch(tier.name, block.nbytes, time.perf_counter() - started)
                if block is None:
                    counters.misses += 1
                    continue
                counters.hits += 1
                if index > 0:
                    counters.promotions += 1
                    block = self._place(0, key, block, stop=index)
                return block, tier.name
            return None

    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None) -> None:
        with self._lock:
            self._counters.puts += 1
            self._place(0, key, block, pinned=pinned, ttl_s=ttl_s)
            if self.write_through_shared:
                for tier in self.tiers[1:]:
                    if tier.is_shared and not tier.contains(key):
                        tier.put(key, block, pinned=pinned, ttl_s=ttl_s)

    def _place(self, index: int, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
               stop: int | None = None) -> KVBlock:
        """Put into tier `index` (falling through to the next on CapacityError); demote what it evicts.
        Returns the block as stored in the tier that took it."""
        stop = len(self.tiers) if stop is None else stop
        for position in range(index, stop):
            tier = self.tiers[position]
            try:
                evicted = tier.put(key, block, pinned=pinned, ttl_s=ttl_s)
            except CapacityError:
                continue
            self._demote(position, evicted)
            stored = tier.get(key)
            return stored if stored is not None else block
        return block

    def _demote(self, position: int, evicted: Iterable[tuple[str, KVBlock]]) -> None:
        counters = self._counters.per_tier[self.tiers[position].name]
        for victim, victim_block in evicted:
            counters.evictions += 1
            below = position + 1
            if below >= len(self.tiers):
                continue
            if self.tiers[below].is_shared and self.tiers[below].contains(victim):
                continue  # already written through
            counters.demotions += 1
            self._place(below, victim, victim_block)

    def contains(self, key: str) -> str | None:
        """Name of the fastest tier holding `key` (no promotion, no counters), or None."""
        with self._lock:
            return next((t.name for t in self.tiers if t.contains(key)), None)

    def locate(self, keys: Iterable[str]) -> dict[str, str | None]:
        return {key: self.contains(key) for key in keys}

    def delete(self, key: str) -> bool:
        with self._lock:
            return any([tier.delete(key) for tier in self.tiers])

    def pin(self, key: str) -> bool:
        with self._lock:
            return any([tier.pin(key) for tier in self.tiers])

    def unpin(self, key: str) -> bool:
        with self._lock:
            return any([tier.unpin(key) for tier in self.tiers])

    def stats(self) -> StoreStats:
        with self._lock:
            tiers = tuple(
                TierStats(t.name, c.hits, c.misses, c.evictions, c.demotions, c.promotions, t.used_bytes,
                          t.max_bytes, len(t.keys()))
                for t in self.tiers for c in [self._counters.per_tier[t.name]])
            return StoreStats(tiers, self._counters.gets, self._counters.puts)
