"""An in-process tier (the model's device, or host memory): LRU per kind under a byte budget, pins, refcounts."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.errors import CapacityError
from promptcache.cache_store.layer_reach import LayerReach
from promptcache.cache_store.tier import BLOCK_KINDS, BlockKind, Eviction, OwnerShares, Tier, TierHit, TierUsage


@dataclass(slots=True)
class _Entry:
    block: KVBlock
    nbytes: int
    kind: BlockKind
    pinned: bool
    expires_at: float | None
    owner: str | None = None


class MemoryTier(Tier):
    """Blocks held as tensors on `device`. Thread-safe; every operation O(1) amortized. Evicts the least
    recently used unpinned, unreferenced "prefix" entry first, then such "module" entries. Pinned and acquired
    entries are never evicted: when only those are left, `put` raises CapacityError. With `shares`, an owner
    past its share evicts its own entries (prefix first), or is refused (CapacityError) when they are all
    pinned or in use, never another owner's."""

    def __init__(self, name: str, max_bytes: int, device: str = "cpu", *, pin_memory: bool = False,
                 clock: Callable[[], float] = time.monotonic, shares: OwnerShares | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"tier {name!r} needs max_bytes > 0, got {max_bytes}")
        self.name = name
        self.max_bytes = max_bytes
        self.device = torch.device(device)
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        # Only evictable (unpinned, unreferenced) keys, oldest first: eviction pops the front, never scans.
        self._lru: dict[BlockKind, OrderedDict[str, None]] = {kind: OrderedDict() for kind in BLOCK_KINDS}
        self._shares = shares or OwnerShares()
        self._owner_lru: dict[str, dict[BlockKind, OrderedDict[str, None]]] = {}  # the same, per owner
        self._owner_bytes: dict[str, int] = {}
        # Refcounts are per key, not per entry, so they survive a delete or re-put of the key.
        self._refs: dict[str, int] = {}
        self._used = self._evictable_bytes = self._prefix_bytes = 0
        self._lock = threading.Lock()

    def lookup(self, key: str, reach: LayerReach | None = None) -> TierHit | None:
        with self._lock:
            entry = self._live(key)
            if entry is None or not entry.block.serves(reach):  # a part read for another request: a miss here
                return None
            self._touch(key)
            ttl = None if entry.expires_at is None else entry.expires_at - self._clock()
            return TierHit(entry.block, entry.kind, ttl, entry.owner)

    def get(self, key: str) -> KVBlock | None:
        """The block under `key`, whole or a part (KVBlock.present); refreshes LRU."""
        with self._lock:
            entry = self._touch(key)
            return None if entry is None else entry.block

    def touch(self, key: str) -> None:
        with self._lock:
            self._touch(key)

    def _touch(self, key: str) -> _Entry | None:
        entry = self._live(key)
        for lru in self._lrus(entry) if entry is not None else ():
            if key in lru:
                lru.move_to_end(key)
        return entry

    def _lrus(self, entry: _Entry) -> list[OrderedDict[str, None]]:
        """The LRU lists `entry` belongs in: its kind's, and its owner's of that kind."""
        lrus = [self._lru[entry.kind]]
        if entry.owner is not None:
            lrus.append(self._owner_lru.setdefault(entry.owner, {k: OrderedDict() for k in BLOCK_KINDS})[entry.kind])
        return lrus

    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
            kind: BlockKind = "module", owner: str | None = None) -> list[Eviction]:
        with self._lock:  # a part never replaces an entry that holds it already (the whole block, or more of it)
            if block.present is not None and (held := self._live(key)) is not None and held.block.serves(block.present):
                return []
        block = block.to(self.device, pin_memory=self.pin_memory)
        nbytes = block.nbytes
        with self._lock:
            old = self._remove(key)  # even a refused put drops the old value: it must not be served as current
            if nbytes > self.max_bytes:
                raise CapacityError(f"a {nbytes}-byte block exceeds tier {self.name!r}'s budget of {self.max_bytes}")
            if old is not None:  # a re-put keeps the pin and never downgrades a "module" entry
                pinned, kind = pinned or old.pinned, "module" if old.kind == "module" else kind
            if self._used - self._evictable_bytes + nbytes > self.max_bytes:
                raise CapacityError(f"tier {self.name!r} holds {self._used - self._evictable_bytes} pinned or "
                                    f"referenced bytes; a {nbytes}-byte block does not fit in {self.max_bytes}")
            now = self._clock()
            evicted: list[Eviction] = []
            limit = self._shares.limit(owner, self.max_bytes)
            # Within its share, an owner makes room from its own entries only (only an owner has a share).
            if limit is not None and owner is not None:
                own = self._owner_lru.get(owner, {})
                while self._owner_bytes.get(owner, 0) + nbytes > limit:
                    if not (own.get("prefix") or own.get("module")):
                        raise CapacityError(f"owner {owner!r} holds {self._owner_bytes.get(owner, 0)} pinned or "
                                            f"in-use bytes of tier {self.name!r}; a {nbytes}-byte block does not "
                                            f"fit in its share of {limit}")
                    self._evict(next(iter(own["prefix"] or own["module"])), now, evicted)
            while self._used + nbytes > self.max_bytes:
                self._evict(next(iter(self._lru["prefix"] or self._lru["module"])), now, evicted)
            self._add(key, _Entry(block, nbytes, kind, pinned, None if ttl_s is None else now + ttl_s, owner))
            return evicted

    def _evict(self, victim: str, now: float, evicted: list[Eviction]) -> None:
        entry = self._remove(victim)
        assert entry is not None
        if entry.expires_at is None or entry.expires_at > now:  # expired entries are not demoted
            ttl = None if entry.expires_at is None else entry.expires_at - now
            evicted.append(Eviction(victim, entry.block, entry.kind, ttl, entry.owner))

    def contains(self, key: str) -> bool:
        with self._lock:
            return self._live(key) is not None

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._remove(key) is not None

    def pin(self, key: str) -> bool:
        return self._set_pin(key, True)

    def unpin(self, key: str) -> bool:
        return self._set_pin(key, False)

    def acquire(self, key: str) -> None:
        with self._lock:
            if (entry := self._entries.get(key)) is not None:
                self._set_evictable(key, entry, False)
            self._refs[key] = self._refs.get(key, 0) + 1

    def release(self, key: str) -> None:
        with self._lock:
            count = self._refs.pop(key, 0)
            if count > 1:
                self._refs[key] = count - 1
            elif count == 1 and (entry := self._entries.get(key)) is not None and not entry.pinned:
                self._set_evictable(key, entry, True)

    @property
    def used_bytes(self) -> int:
        return self._used

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._used, len(self._entries), self._prefix_bytes,
                             sum(1 for key in self._refs if key in self._entries))

    def _set_pin(self, key: str, pinned: bool) -> bool:
        with self._lock:
            if (entry := self._live(key)) is not None:
                entry.pinned = pinned
                self._set_evictable(key, entry, not pinned and key not in self._refs)
            return entry is not None

    def _set_evictable(self, key: str, entry: _Entry, evictable: bool) -> None:
        """Moves `key` in or out of its kind's LRU; an entry that becomes evictable counts as just used."""
        lrus = self._lrus(entry)
        if evictable and key not in lrus[0]:
            for lru in lrus:
                lru[key] = None
            self._evictable_bytes += entry.nbytes
        elif not evictable and key in lrus[0]:
            for lru in lrus:
                del lru[key]
            self._evictable_bytes -= entry.nbytes

    def _add(self, key: str, entry: _Entry) -> None:
        self._entries[key] = entry
        self._count(entry, entry.nbytes)
        self._set_evictable(key, entry, not entry.pinned and key not in self._refs)

    def _remove(self, key: str) -> _Entry | None:
        if (entry := self._entries.pop(key, None)) is not None:
            self._set_evictable(key, entry, False)
            self._count(entry, -entry.nbytes)
        return entry

    def _count(self, entry: _Entry, nbytes: int) -> None:
        """Add `nbytes` (negative: remove) to the byte counts `entry` is in."""
        self._used += nbytes
        if entry.owner is not None:
            self._owner_bytes[entry.owner] = self._owner_bytes.get(entry.owner, 0) + nbytes
        if entry.kind == "prefix":
            self._prefix_bytes += nbytes

    def _live(self, key: str) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at is not None and self._clock() >= entry.expires_at:
            self._remove(key)
            return None
        return entry
