"""The interface every storage tier implements, and the small records tiers hand back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Literal, NamedTuple, get_args

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.layer_reach import LayerReach

BlockKind = Literal["module", "prefix"]
"""A module's KV ("module"), or a cache of work done for requests ("prefix": a prefix block, or a module's second
encoding): every tier evicts unpinned, unreferenced "prefix" entries (LRU) before any "module" entry."""

BLOCK_KINDS: tuple[BlockKind, ...] = get_args(BlockKind)


class TierHit(NamedTuple):
    """A block found in a tier, with its kind, remaining TTL (None: none) and owner (whose share it counts in)."""

    block: KVBlock
    kind: BlockKind = "module"
    ttl_s: float | None = None
    owner: str | None = None


class TierUsage(NamedTuple):
    """What a tier holds right now (for stats)."""

    used_bytes: int
    num_entries: int
    prefix_bytes: int = 0
    num_referenced: int = 0


class Eviction(tuple[str, KVBlock]):
    """An entry a tier evicted. Unpacks as `(key, block)`; also carries its kind, remaining TTL and owner so
    a demotion keeps them."""

    kind: BlockKind
    ttl_s: float | None
    owner: str | None

    def __new__(cls, key: str, block: KVBlock, kind: BlockKind = "module", ttl_s: float | None = None,
                owner: str | None = None) -> Eviction:
        self = super().__new__(cls, (key, block))
        self.kind, self.ttl_s, self.owner = kind, ttl_s, owner
        return self

    @property
    def key(self) -> str:
        return self[0]

    @property
    def block(self) -> KVBlock:
        return self[1]


class Tier(ABC):
    """One level of the KV store with a byte budget. `put` returns the entries it evicted, to be demoted.
    `is_shared` tiers (Redis, disk) are visible to other processes and do I/O (called outside the store's lock);
    refcounts (`acquire`/`release`) only matter to in-process tiers. Tiers given `OwnerShares` keep an owner (a
    tenant) within its share by evicting its own entries first, never another tenant's."""

    name: str
    max_bytes: int
    is_shared: bool = False

    @abstractmethod
    def lookup(self, key: str, reach: LayerReach | None = None) -> TierHit | None:
        """The entry under `key` with its kind, remaining TTL and owner (refreshes LRU); None if absent. `reach`: what
        of the block the caller reads (None: all); a shared tier may fetch only that part (KVBlock.present says what
        it holds), an in-process tier serves an entry only if it holds that part."""

    def get(self, key: str) -> KVBlock | None:
        """The block under `key` (refreshes LRU like `lookup`); None if absent."""
        hit = self.lookup(key)
        return None if hit is None else hit.block

    @abstractmethod
    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
            kind: BlockKind = "module", owner: str | None = None) -> list[Eviction]: ...

    @abstractmethod
    def contains(self, key: str) -> bool:
        """True if `key` holds a value `get` would serve — in shared tiers, one that passes verification
        (a failing one is dropped). Never marks the entry as used."""

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

    def touch(self, key: str) -> None:
        """Mark `key` as just used (LRU) without reading it. No-op by default."""
        return None

    def acquire(self, key: str) -> None:
        """Count one user of `key`: a referenced entry is never evicted until released. No-op by default."""
        return None

    def release(self, key: str) -> None:
        """Undo one `acquire`; never goes below zero. No-op by default."""
        return None

    def usage(self) -> TierUsage:
        """Bytes and entries held now; tiers override this with something cheaper than `keys()`."""
        return TierUsage(self.used_bytes, len(self.keys()))


class OwnerShares:
    """Byte shares of a tier's budget per owner: `limit(owner, max_bytes)` is the most bytes the owner's
    entries may hold (None: no limit — entries without an owner, owners without a share)."""

    def __init__(self, shares: Mapping[str, float] | None = None) -> None:
        self.shares = dict(shares or {})
        for owner, share in self.shares.items():
            if not 0 < share <= 1:
                raise ValueError(f"the byte share of {owner!r} must be in (0, 1], got {share}")

    def limit(self, owner: str | None, max_bytes: int) -> int | None:
        share = self.shares.get(owner) if owner is not None else None
        return None if share is None else int(share * max_bytes)
