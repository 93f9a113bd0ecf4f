"""The shared tier: KV blocks in Redis under `promptcache:<namespace>:`, visible to every replica.
The byte budget is kept by an LRU index in Redis (sorted set, sizes, byte counters, pins, and per owner a sorted
set and a byte count), changed only by the Lua scripts of redis_scripts.py, so replicas see one consistent index.
Scores are a shared use counter (clock skew cannot matter), plus `MODULE_SCORE_OFFSET` for "module" entries:
eviction (lowest first) takes "prefix" entries first, each kind in LRU order, and a write past its owner's share
evicts that owner's own entries first. A write makes room before it writes, and shrinks the tier when Redis
itself is full (redis_scripts.py). A read verifies the blob (HMAC tag, checksum, key, decoding) before a
script marks it used if it is still the value verified; a failing value is deleted only if it is still the bytes
read. `contains` counts only verified values (verified_heads.py). A lookup for part of a block (`reach`, a sliding
window's) reads its head, then only that part, in two round trips, and checks what it read (block_format.py)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.block_format import dumps, layout_of, loads, read_part
from promptcache.cache_store.block_layout import HEADER_BYTES, Layout, Ranges
from promptcache.cache_store.errors import CacheStoreError, logger
from promptcache.cache_store.layer_reach import LayerReach
from promptcache.cache_store.redis_scripts import DELETE, DROP_IF_UNCHANGED, MODULE_SCORE_OFFSET, PUT, TOUCH
from promptcache.cache_store.signing import HEAD_SEAL_BYTES, BlobSigner
from promptcache.cache_store.tier import BlockKind, Eviction, OwnerShares, Tier, TierHit, TierUsage
from promptcache.cache_store.verified_heads import HEAD_BYTES, VerifiedHeads, fingerprint

T = TypeVar("T")


class _ReadWhole(Exception):
    """A part read that could not be made: the value is read whole."""


class _Absent(Exception):
    """A part read of a key Redis does not hold."""


def redacted(url: str) -> str:
    """`url` without its password, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)))


class RedisGuard:
    """Runs Redis calls: a failure is a miss plus a rate-limited warning, and Redis is skipped for
    `retry_interval_s` so a dead server costs at most one bounded timeout per interval. A write refused because
    Redis is full (its maxmemory, noeviction) is a warning only: Redis answers, and reads go on."""

    def __init__(self, what: str, retry_interval_s: float = 2.0, warn_interval_s: float = 30.0) -> None:
        self.what = what
        self.retry_interval_s = retry_interval_s
        self.warn_interval_s = warn_interval_s
        self._down_until = 0.0
        self._last_warning = -1e9
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], default: T) -> T:
        if time.monotonic() < self._down_until:
            return default
        try:
            return fn()
        except redis.exceptions.OutOfMemoryError as exc:
            self.warn_full(str(exc))
            return default
        except (redis.RedisError, OSError) as exc:
            now = time.monotonic()
            with self._lock:
                self._down_until = now + self.retry_interval_s
                if now - self._last_warning >= self.warn_interval_s:
                    self._last_warning = now
                    logger.warning("%s unavailable (%s: %s); treating as a miss, retrying in %.1fs",
                                   self.what, type(exc).__name__, exc, self.retry_interval_s)
            return default

    def warn_full(self, detail: str) -> None:
        """Warn (rate-limited) that Redis is at its maxmemory and a write was not made."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_warning < self.warn_interval_s:
                return
            self._last_warning = now
        logger.warning("%s is full (maxmemory): %s; raise its maxmemory or lower PROMPTCACHE_REDIS_MAX_BYTES",
                       self.what, detail)


class RedisTier(Tier):
    """KV blocks serialized into Redis under a byte budget; Redis failures are misses, never errors. Evicts
    unpinned "prefix" entries (LRU) before unpinned "module" ones; no refcounts. With a keyed `signer`, every
    blob carries an HMAC (signing.py). `url`: `redis://` or `rediss://` (TLS, `?ssl_ca_certs=...` as redis-py
    parses it), with an optional ACL user and password (`redis://user:password@host:port/db`)."""

    is_shared = True

    def __init__(self, url: str, *, max_bytes: int, namespace: str = "default", timeout_s: float = 0.5,
                 retry_interval_s: float = 2.0, name: str = "redis", signer: BlobSigner | None = None,
                 shares: OwnerShares | None = None) -> None:
        self.name = name
        self.signer = signer or BlobSigner()
        self.shares = shares or OwnerShares()
        self.max_bytes = max_bytes
        self.prefix = f"promptcache:{namespace}:"
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.guard = RedisGuard(f"Redis tier at {redacted(url)}", retry_interval_s)
        self._put, self._touch, self._delete, self._drop_if_unchanged = (
            self.client.register_script(script) for script in (PUT, TOUCH, DELETE, DROP_IF_UNCHANGED))
        self.heads = VerifiedHeads()
        self.bytes_read = 0  # of KV values, whole or in part (what fetches cost)
        # Layouts by block length, written or read here: a part read guesses one and, when right, makes one round trip.
        self._layouts: OrderedDict[int, Layout] = OrderedDict()
        self._layouts_lock = threading.Lock()
        self._lru, self._sizes, self._pins, self._total, self._prefix_total, self._seq = (
            self.prefix + s for s in ("lru", "size", "pins", "bytes", "prefix_bytes", "seq"))
        self._owners, self._owner_bytes, self._own_prefix = (self.prefix + s for s in ("owner", "owner_bytes", "lru@"))

    def _blob_key(self, key: str) -> str:
        return f"{self.prefix}kv:{key}"

    def lookup(self, key: str, reach: LayerReach | None = None) -> TierHit | None:
        if reach is not None and not reach.is_whole:
            try:
                return self.guard.call(lambda: self._lookup_part(key, reach), None)
            except _ReadWhole:
                pass
        blob_key = self._blob_key(key)

        def read(pipe: Any) -> None:  # kind, TTL, owner and blob of one state
            pipe.zscore(self._lru, key)
            pipe.pttl(blob_key)
            pipe.hget(self._owners, key)
            pipe.get(blob_key)

        reply = self.guard.call(lambda: self._read(read), None)
        if reply is None or reply[3] is None:
            return None
        score, ttl_ms, owner, sealed = reply
        self.bytes_read += len(sealed)
        block = self._verify(key, sealed)
        if block is None:
            return None
        return self._hit(key, block, score, ttl_ms, owner, len(sealed), sealed[:HEAD_BYTES])

    def _hit(self, key: str, block: KVBlock, score: Any, ttl_ms: int, owner: Any, length: int, head: bytes) -> TierHit:
        """A verified read's entry, marked as used only now, and only if the value is still the one verified."""
        self.guard.call(lambda: self._touch(keys=[self._blob_key(key), self._lru, self._seq, self._owners],
                                            args=[key, self._own_prefix, length, head]), None)
        kind: BlockKind = "prefix" if score is not None and score < MODULE_SCORE_OFFSET else "module"
        owner = owner.decode() if isinstance(owner, bytes) else owner
        return TierHit(block, kind, None if ttl_ms < 0 else ttl_ms / 1000, owner or None)

    def _lookup_part(self, key: str, reach: LayerReach) -> TierHit | None:
        """The part of `key`'s block that `reach` reads, or None (absent). Raises _ReadWhole when it cannot be read
        in part (an older format, a value that fails or changes under the read): the caller reads it whole, which
        verifies it in full and drops a damaged value."""
        blob_key, seal = self._blob_key(key), HEAD_SEAL_BYTES if self.signer.enabled else 0
        head_bytes = max(HEAD_BYTES, seal + HEADER_BYTES)  # the seal, the header (and the fingerprint's bytes)
        meta: list[Any] = []  # score, TTL, owner, length and head of the value, from the first read

        def read(ranges: Ranges) -> list[bytes]:
            def queue(pipe: Any) -> None:  # one state; the head again with every read, which must be the same
                if not meta:
                    pipe.zscore(self._lru, key)
                    pipe.pttl(blob_key)
                    pipe.hget(self._owners, key)
                    pipe.strlen(blob_key)
                for start, stop in ranges:
                    pipe.getrange(blob_key, start, stop - 1)
                pipe.getrange(blob_key, 0, head_bytes - 1)

            replies = self._read(queue)
            if not meta:
                meta.extend([*replies[:4], replies[-1]])
                replies = replies[4:]
                if not meta[3]:
                    raise _Absent
            elif replies[-1] != meta[4]:
                raise CacheStoreError("the value changed between two reads of its part")
            self.bytes_read += sum(map(len, replies))
            return list(replies[:-1])

        def authentic(head_and_table: bytes) -> bool:
            return self.signer.check_head(blob_key, meta[4][:seal], head_and_table)

        try:
            block = read_part(read, reach, expect_key=key, base=seal, secure=self.signer.enabled,
                              check_head=authentic if self.signer.enabled else None,
                              guess=None if reach.num_tokens is None else self._layouts.get(reach.num_tokens))
        except _Absent:
            return None
        except CacheStoreError as exc:
            raise _ReadWhole from exc
        if block is None:
            raise _ReadWhole
        score, ttl_ms, owner, length, head = meta
        self._remember_layout(layout_of(head[seal:]))
        return self._hit(key, block, score, ttl_ms, owner, length, head[:HEAD_BYTES])

    def _remember_layout(self, layout: Layout | None) -> None:
        if layout is None:
            return
        with self._layouts_lock:
            self._layouts[layout.shape[2]] = layout
            self._layouts.move_to_end(layout.shape[2])
            while len(self._layouts) > 256:
                self._layouts.popitem(last=False)

    def _verify(self, key: str, sealed: bytes) -> KVBlock | None:
        """The block in `sealed` (just read for `key`), or None: it failed verification (logged) and is
        deleted unless a write replaced it meanwhile."""
        opened = self.signer.open_block(self._blob_key(key), sealed)  # None: no valid tag (logged)
        try:
            block = None if opened is None else loads(opened[0], expect_key=key, secure=opened[1])
        except CacheStoreError as exc:
            logger.warning("dropping corrupted KV block %s from Redis: %s", key[:12], exc)
            block = None
        if block is None:
            self.heads.forget(key)
            self.guard.call(lambda: self._drop_if_unchanged(keys=self._entry_keys(key),
                                                            args=[key, self._own_prefix, sealed]), 0)
            return None
        self.heads.remember(key, fingerprint(len(sealed), sealed[:HEAD_BYTES]))
        return block

    def _read(self, queue: Callable[[Any], None]) -> list[Any]:
        """The replies of the reads `queue` adds to a pipeline, run as one MULTI (one state). Redis at its maxmemory
        refuses every MULTI, reads too: then they run as a plain pipeline, so a full Redis still serves reads."""
        try:
            pipe = self.client.pipeline(transaction=True)
            queue(pipe)
            return pipe.execute()
        except redis.exceptions.OutOfMemoryError:
            pipe = self.client.pipeline(transaction=False)
            queue(pipe)
            return pipe.execute()

    def _entry_keys(self, key: str) -> list[str]:
        """The Redis keys a write or delete of `key` touches (PUT/DELETE's layout)."""
        return [self._blob_key(key), self._lru, self._sizes, self._pins, self._total, self._prefix_total, self._seq,
                self._owners, self._owner_bytes]

    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
            kind: BlockKind = "module", owner: str | None = None) -> list[Eviction]:
        value = dumps(block, key, secure=self.signer.enabled)
        layout = Layout.parse(value)
        self._remember_layout(layout)
        blob = self.signer.seal_head(self._blob_key(key), value, layout.head_bytes)
        limit = self.shares.limit(owner, self.max_bytes)
        if len(blob) > (self.max_bytes if limit is None else limit):
            return []
        ttl_ms = 0 if ttl_s is None else max(1, int(ttl_s * 1000))
        args: list[str | bytes | int] = [key, blob, ttl_ms, int(pinned), kind, self.max_bytes, self.prefix + "kv:",
                                         owner or "", limit or 0, self._own_prefix]
        self.heads.remember(key, fingerprint(len(blob), blob[:HEAD_BYTES]))  # what we write, we trust
        if self.guard.call(lambda: self._put(keys=self._entry_keys(key), args=args), None) == 0:
            self.guard.warn_full("too little of this tier is left to evict; a KV write was skipped")
        return []  # the last shared tier: evicted blocks are dropped

    def contains(self, key: str) -> bool:
        """True if `key` holds a value that passes verification: one round trip (length and first bytes) for
        a value verified here before, else a full read. Never marks the entry as used."""
        blob_key = self._blob_key(key)

        def head(pipe: Any) -> None:
            pipe.strlen(blob_key)
            pipe.getrange(blob_key, 0, HEAD_BYTES - 1)

        length, first = self.guard.call(lambda: cast("tuple[int, bytes]", tuple(self._read(head))), (0, b""))
        if not length:
            return False
        if self.heads.vouches(key, fingerprint(length, first)):
            return True
        sealed = self.guard.call(lambda: cast("bytes | None", self.client.get(blob_key)), None)
        return sealed is not None and self._verify(key, sealed) is not None

    def delete(self, key: str) -> bool:
        self.heads.forget(key)
        return bool(self.guard.call(lambda: self._delete(keys=self._entry_keys(key), args=[key, self._own_prefix]), 0))

    def pin(self, key: str) -> bool:
        return bool(self.guard.call(lambda: self.client.sadd(self._pins, key), 0)) or self.contains(key)

    def unpin(self, key: str) -> bool:
        return bool(self.guard.call(lambda: self.client.srem(self._pins, key), 0))

    @property
    def used_bytes(self) -> int:
        return int(self.guard.call(lambda: self.client.get(self._total), None) or 0)

    def keys(self) -> list[str]:
        empty: list[bytes | str] = []
        raw = self.guard.call(lambda: cast("list[bytes | str]", self.client.zrange(self._lru, 0, -1)), empty)
        return [k.decode() if isinstance(k, bytes) else k for k in raw]

    def usage(self) -> TierUsage:
        def read() -> TierUsage:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(self._total)
            pipe.get(self._prefix_total)
            pipe.zcard(self._lru)
            total, prefix, count = pipe.execute()
            return TierUsage(int(total or 0), int(count), int(prefix or 0))

        return self.guard.call(read, TierUsage(0, 0))
