"""TieredStore: device -> host -> shared (Redis / disk) with promotion on hit, demotion on eviction,
refcounts on in-process entries, and write-behind to the shared tiers (write_behind.py)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.errors import CapacityError, logger
from promptcache.cache_store.fetch_policy import FetchPolicy
from promptcache.cache_store.layer_reach import LayerReach
from promptcache.cache_store.tier import BLOCK_KINDS, BlockKind, Eviction, Tier
from promptcache.cache_store.write_behind import WriteBehind

T = TypeVar("T")


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
    prefix_bytes: int = 0
    module_bytes: int = 0
    num_referenced: int = 0  # entries in use (acquired); in-process tiers only


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: tuple[TierStats, ...]
    num_gets: int
    num_puts: int
    dropped_writes: int = 0        # shared-tier writes dropped because the write-behind queue was full
    pending_write_bytes: int = 0   # bytes queued for (or being written to) the shared tiers
    num_pending_writes: int = 0


class TieredStore:
    """KV blocks in tiers ordered fastest first: in-process tiers, then shared ones. Thread-safe. `get` promotes
    a hit (with its kind and TTL) to the faster tiers; `put` writes the first tier synchronously, and demotes
    evictions down the chain. Shared-tier writes queue on a WriteBehind of `write_behind_max_bytes` (more is
    dropped, `stats().dropped_writes`), never under the store's lock; a `delete` cancels the key's queued
    writes and follows a running one. `acquire`/`release` keep in-process entries from eviction while in use."""

    def __init__(self, tiers: Sequence[Tier], *, write_through_shared: bool = True,
                 policy: FetchPolicy | None = None, write_behind_max_bytes: int = 1 << 30) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        if write_behind_max_bytes <= 0:
            raise ValueError(f"write_behind_max_bytes must be > 0, got {write_behind_max_bytes}")
        self.tiers = list(tiers)
        self._num_local = next((i for i, t in enumerate(self.tiers) if t.is_shared), len(self.tiers))
        self._local, self._shared = self.tiers[:self._num_local], self.tiers[self._num_local:]
        if not all(t.is_shared for t in self._shared):
            raise ValueError("in-process tiers must come before shared tiers")
        self.write_through_shared = write_through_shared
        self.policy = policy or FetchPolicy()
        self._lock = threading.RLock()
        self._counters = {t.name: TierCounters() for t in self.tiers}
        self._num_gets = self._num_puts = 0
        self._writer = WriteBehind(write_behind_max_bytes)
        self._held: dict[str, list[tuple[Tier, ...]]] = {}  # key -> tiers of each outstanding acquire

    def get(self, key: str, *, num_tokens: int | None = None, nbytes: int | None = None, promote: bool = True,
            reach: LayerReach | None = None) -> tuple[KVBlock, str] | None:
        """The block and the name of its tier. `num_tokens`/`nbytes` let the fetch policy skip a shared tier
        slower than recomputing; `promote=False` copies no hit into faster tiers (see `put`'s `local`). `reach`: what
        the caller reads of the block (None: all of it): a shared tier fetches only that (KVBlock.present); such a
        part is promoted for requests it covers, never written back to a shared tier."""
        with self._lock:
            self._num_gets += 1
        for index, tier in enumerate(self.tiers):
            counters = self._counters[tier.name]
            if not tier.is_shared:
                with self._lock:
                    hit = tier.lookup(key, reach)
            elif nbytes is not None and not self.policy.worth_fetching(tier.name, nbytes, num_tokens):
                hit = None
            else:
                started = time.perf_counter()
                hit = _shared_call(tier, "read", functools.partial(tier.lookup, key, reach), None)  # I/O: no lock
                if hit is not None:
                    self.policy.record_fetch(tier.name, hit.block.held_nbytes, time.perf_counter() - started)
            with self._lock:
                if hit is None:
                    counters.misses += 1
                    continue
                counters.hits += 1
                if index == 0 or not promote:
                    return hit.block, tier.name
                counters.promotions += 1
                # From an in-process tier below (host memory under a GPU), only the part the caller reads moves up.
                block = hit.block.part(reach) if index < self._num_local else hit.block
                placed = self._place(0, key, block, kind=hit.kind, ttl_s=hit.ttl_s, stop=index, owner=hit.owner)
                return placed or hit.block, tier.name
        return None

    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
            kind: BlockKind = "module", owner: str | None = None, local: bool = True) -> None:
        """Store `block` under `key`: synchronously in the first tier that takes it, and queued for the
        shared tiers. A re-put keeps an existing pin, refcount and "module" kind. `owner` (a tenant) is
        whose byte share the entry counts against. `local=False`: a block computed for others (a replica
        encoding an uploaded schema) goes to the shared tiers only, unless there are none."""
        if kind not in BLOCK_KINDS:
            raise ValueError(f"block kind must be one of {BLOCK_KINDS}, got {kind!r}")
        if block.present is not None:
            raise ValueError("a block read in part is not stored: it lacks KV other requests read")
        local = local or not self._shared
        with self._lock:
            self._num_puts += 1
            placed = self._place(0, key, block, pinned=pinned, ttl_s=ttl_s, kind=kind, owner=owner) if local else None
        if not self._shared:
            return
        deadline = None if ttl_s is None else time.monotonic() + ttl_s
        if self.write_through_shared or not local:
            self._writer.submit(key, block.nbytes,
                                lambda: self._write_through(key, block, pinned, kind, deadline, owner))
        elif placed is None:
            self._writer.submit(key, block.nbytes, lambda: self._demote_shared(
                self._num_local, key, block, kind, deadline, owner, pinned=pinned))

    def _place(self, index: int, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
               kind: BlockKind = "module", stop: int | None = None, owner: str | None = None) -> KVBlock | None:
        """Under the lock: put into in-process tier `index` (falling through to the next on CapacityError)
        and demote what it evicts. Returns the block as stored, or None if no tier before `stop` took it."""
        stop = self._num_local if stop is None else min(stop, self._num_local)
        for position in range(index, stop):
            tier = self.tiers[position]
            try:
                evicted = tier.put(key, block, pinned=pinned, ttl_s=ttl_s, kind=kind, owner=owner)
            except CapacityError:
                continue
            self._demote(position, evicted)
            return tier.get(key)
        return None

    def _demote(self, position: int, evicted: Iterable[Eviction]) -> None:
        """Move what tier `position` evicted to the next tier: in-process ones now (under the lock), shared
        ones through the writer (directly when already on it)."""
        counters, below = self._counters[self.tiers[position].name], position + 1
        for victim in evicted:
            key, block, kind, ttl_s, owner = victim.key, victim.block, victim.kind, victim.ttl_s, victim.owner
            # A part goes down the in-process tiers only: a shared tier holds (or held) the whole block.
            demoted = below < len(self.tiers) and (block.present is None or below < self._num_local)
            with self._lock:
                counters.evictions += 1
                counters.demotions += demoted
            if not demoted:
                continue
            if below < self._num_local:
                self._place(below, key, block, kind=kind, ttl_s=ttl_s, owner=owner)
                continue
            deadline = None if ttl_s is None else time.monotonic() + ttl_s
            demote = functools.partial(self._demote_shared, below, key, block, kind, deadline, owner)
            if position >= self._num_local:
                demote()
            else:
                self._writer.submit(key, block.nbytes, demote)

    def _write_through(self, key: str, block: KVBlock, pinned: bool, kind: BlockKind,
                       deadline: float | None, owner: str | None) -> None:
        """On the writer: put into every shared tier that lacks the key."""
        for position in range(self._num_local, len(self.tiers)):
            if not self.tiers[position].contains(key):
                self._store_shared([position], key, block, pinned, kind, deadline, owner)
            elif pinned:
                self.tiers[position].pin(key)

    def _demote_shared(self, position: int, key: str, block: KVBlock, kind: BlockKind, deadline: float | None,
                       owner: str | None, *, pinned: bool = False) -> None:
        """On the writer: put into the first shared tier from `position` that takes it, unless already there."""
        if not self.tiers[position].contains(key):
            self._store_shared(range(position, len(self.tiers)), key, block, pinned, kind, deadline, owner)

    def _store_shared(self, positions: Iterable[int], key: str, block: KVBlock, pinned: bool, kind: BlockKind,
                      deadline: float | None, owner: str | None) -> None:
        """Put into the first tier of `positions` that takes the block."""
        ttl_s = None if deadline is None else deadline - time.monotonic()
        if ttl_s is not None and ttl_s <= 0:
            return  # expired while queued
        for index in positions:
            tier = self.tiers[index]
            try:
                evicted = _shared_call(tier, "write", functools.partial(
                    tier.put, key, block, pinned=pinned, ttl_s=ttl_s, kind=kind, owner=owner), None)
            except CapacityError:
                continue
            if evicted is not None:  # None: the tier failed (warned); the block stays where it was
                self._demote(index, evicted)
            return

    def tier_of(self, key: str) -> Tier | None:
        """The fastest (reachable) tier holding `key`, or None; no promotion, no counters."""
        with self._lock:
            local = next((t for t in self._local if t.contains(key)), None)
        return local or next((t for t in self._shared
                              if _shared_call(t, "look up", functools.partial(t.contains, key), False)), None)

    def delete(self, key: str) -> bool:
        """Remove `key` from every tier and cancel its queued shared writes; a write already running is
        followed by a second delete, so it cannot resurrect the key. Refcounts are kept."""
        with self._lock:
            found = any([tier.delete(key) for tier in self._local])
        is_running = self._writer.cancel(key)
        found = any([tier.delete(key) for tier in self._shared]) or found
        if is_running:
            self._writer.submit(key, 0, lambda: [tier.delete(key) for tier in self._shared])
        return found

    def pin(self, key: str) -> bool:
        return self._on_tiers(key, lambda tier: tier.pin(key))

    def unpin(self, key: str) -> bool:
        return self._on_tiers(key, lambda tier: tier.unpin(key))

    def _on_tiers(self, key: str, op: Callable[[Tier], bool]) -> bool:
        """Run `op` on every tier: the shared ones now, or behind the key's queued write so it applies after it."""
        with self._lock:
            found = any([op(tier) for tier in self._local])
        if self._shared and self._writer.has_pending(key):
            self._writer.submit(key, 0, lambda: [op(tier) for tier in self._shared])
            return True
        return any([op(tier) for tier in self._shared]) or found

    def touch(self, keys: Iterable[str]) -> None:
        """Mark `keys` as just used in the in-process tiers, in order (the last ends up most recent), no I/O.
        Touch prefix chains leaf first, so that LRU eviction takes leaves before the links they hang from."""
        with self._lock:
            for key in keys:
                for tier in self._local:
                    tier.touch(key)

    def acquire(self, keys: Iterable[str]) -> None:
        """Mark `keys` in use: their in-process entries are not evicted until `release` (others are skipped)."""
        with self._lock:
            for key in keys:
                holders = tuple(tier for tier in self._local if tier.contains(key))
                for tier in holders:
                    tier.acquire(key)
                if holders:
                    self._held.setdefault(key, []).append(holders)

    def release(self, keys: Iterable[str]) -> None:
        """Undo one `acquire` of each key; releasing more than was acquired is a no-op."""
        with self._lock:
            for key in keys:
                held = self._held.get(key)
                if not held:
                    continue
                for tier in held.pop():
                    tier.release(key)
                if not held:
                    del self._held[key]

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued shared-tier write has been attempted; False if `timeout_s` ran out."""
        return self._writer.flush(timeout_s)

    def close(self, timeout_s: float | None = 10.0) -> bool:
        """Flush (bounded by `timeout_s`), drop what is still queued, stop the writer thread (a later shared write
        starts it again). False if writes were dropped."""
        return self._writer.close(timeout_s)

    def stats(self) -> StoreStats:
        with self._lock:
            counters = [(t, replace(self._counters[t.name])) for t in self.tiers]
            gets, puts = self._num_gets, self._num_puts
        tiers = []
        for t, c in counters:
            usage = t.usage()  # shared tiers do I/O: outside the lock
            tiers.append(TierStats(t.name, c.hits, c.misses, c.evictions, c.demotions, c.promotions,
                                   usage.used_bytes, t.max_bytes, usage.num_entries, usage.prefix_bytes,
                                   usage.used_bytes - usage.prefix_bytes, usage.num_referenced))
        return StoreStats(tuple(tiers), gets, puts, self._writer.num_dropped, self._writer.pending_bytes,
                          self._writer.num_pending)


def _shared_call(tier: Tier, what: str, fn: Callable[[], T], default: T) -> T:
    """A shared tier's failure (Redis, disk) is a miss plus a warning, never an error for the caller;
    tiers handle their expected errors themselves, this catches the unexpected ones."""
    try:
        return fn()
    except CapacityError:
        raise  # a full tier is a decision for the caller, not a failure
    except Exception as exc:
        logger.warning("%s tier failed to %s a block (%s: %s); treating it as a miss", tier.name, what,
                       type(exc).__name__, exc)
        return default
