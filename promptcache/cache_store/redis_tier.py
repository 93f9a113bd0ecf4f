"""The shared tier: KV blocks in Redis, visible to every replica and surviving restarts.

Keys live under `promptcache:<namespace>:`. The byte budget is enforced by an LRU index kept in Redis:
a sorted set ranking entries by last use, a hash of sizes, byte counters (all, and prefix entries), a set
of pinned keys, a use counter, and per owner (tenant) a sorted set and a byte count. Writes, touches and
deletes each run as one Lua script (redis_scripts.py), so replicas sharing the server see one consistent
index.

A read GETs the blob (with its kind, TTL and owner, in one MULTI), verifies it (HMAC tag when a blob key is
set, checksum, key, decoding), and only then marks it as used, by a script that checks the value is still
the one verified. A value that fails verification is never touched: it is deleted, by a script that deletes
it only if it is still exactly the bytes read (a rightful write that landed meanwhile stays). `contains`
counts only verified values (verified_heads.py), so a failing value never blocks the write-through that
replaces it, nor shows as cached in `explain`.

Scores are a shared use counter (not wall-clock time, so replicas with skewed clocks still agree), offset
for "module" entries (redis_scripts.py): the kind of an entry is read back from its score.
"""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.errors import CacheStoreError
from promptcache.cache_store.redis_guard import RedisGuard, logger
from promptcache.cache_store.redis_scripts import DELETE, DROP_IF_UNCHANGED, MODULE_SCORE_OFFSET, PUT, TOUCH
from promptcache.cache_store.serialization import dumps, loads
from promptcache.cache_store.signing import BlobSigner
from promptcache.cache_store.tier import BlockKind, Eviction, OwnerShares, Tier, TierHit, TierUsage
from promptcache.cache_store.verified_heads import HEAD_BYTES, VerifiedHeads, fingerprint


def redacted(url: str) -> str:
    """`url` without its password, for logs and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


class RedisTier(Tier):
    """KV blocks serialized into Redis under a byte budget. Redis failures are misses, never errors.

    Evicts unpinned "prefix" entries (LRU) before unpinned "module" entries (LRU); pinned entries
    stay. Refcounts do not apply here (they protect in-process entries only). With a keyed `signer`,
    every blob carries an HMAC (signing.py); one that fails it is handled as any failed verification.

    `url` may be `redis://`, `rediss://` (TLS; `?ssl_ca_certs=...&ssl_cert_reqs=...` as redis-py
    parses them) and may carry an ACL user and password (`redis://user:password@host:port/db`).
    """

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
        self._put = self.client.register_script(PUT)
        self._touch = self.client.register_script(TOUCH)
        self._delete = self.client.register_script(DELETE)
        self._drop_if_unchanged = self.client.register_script(DROP_IF_UNCHANGED)
        self.heads = VerifiedHeads()
        self._lru, self._sizes, self._pins, self._total, self._prefix_total, self._seq = (
            self.prefix + s for s in ("lru", "size", "pins", "bytes", "prefix_bytes", "seq"))
        self._owners, self._owner_bytes, self._own_prefix = (
            self.prefix + s for s in ("owner", "owner_bytes", "lru@"))

    def _blob_key(self, key: str) -> str:
        return f"{self.prefix}kv:{key}"

    def lookup(self, key: str) -> TierHit | None:
        blob_key = self._blob_key(key)

        def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=True)  # one MULTI: kind, TTL, owner and blob of one state
            pipe.zscore(self._lru, key)
            pipe.pttl(blob_key)
            pipe.hget(self._owners, key)
            pipe.get(blob_key)
            return pipe.execute()

        reply = self.guard.call(read, None)
        if reply is None or reply[3] is None:
            return None
        score, ttl_ms, owner, sealed = reply
        block = self._verify(key, sealed)
        if block is None:
            return None
        # Marked as used only now, and only if the value is still the one verified.
        self.guard.call(lambda: self._touch(keys=[blob_key, self._lru, self._seq, self._owners],
                                            args=[key, self._own_prefix, len(sealed), sealed[:HEAD_BYTES]]), None)
        kind: BlockKind = "prefix" if score is not None and score < MODULE_SCORE_OFFSET else "module"
        owner = owner.decode() if isinstance(owner, bytes) else owner
        return TierHit(block, kind, None if ttl_ms < 0 else ttl_ms / 1000, owner or None)

    def _verify(self, key: str, sealed: bytes) -> KVBlock | None:
        """The block in `sealed` (the blob just read for `key`), or None: then it failed verification
        (logged) and is deleted unless a write replaced it meanwhile."""
        data = self.signer.open(self._blob_key(key), sealed)  # None: no valid tag (logged)
        try:
            block = None if data is None else loads(data, expect_key=key)
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

    def _entry_keys(self, key: str) -> list[str]:
        """The Redis keys a write or delete of `key` touches (redis_scripts.py's PUT/DELETE layout)."""
        return [self._blob_key(key), self._lru, self._sizes, self._pins, self._total, self._prefix_total, self._seq,
                self._owners, self._owner_bytes]

    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
            kind: BlockKind = "module", owner: str | None = None) -> list[Eviction]:
        blob = self.signer.seal(self._blob_key(key), dumps(block, key))
        limit = self.shares.limit(owner, self.max_bytes)
        if len(blob) > (self.max_bytes if limit is None else limit):
            return []
        ttl_ms = 0 if ttl_s is None else max(1, int(ttl_s * 1000))
        args: list[str | bytes | int] = [key, blob, ttl_ms, int(pinned), kind, self.max_bytes, self.prefix + "kv:",
                                         owner or "", limit or 0, self._own_prefix]
        self.heads.remember(key, fingerprint(len(blob), blob[:HEAD_BYTES]))  # what we write, we trust
        self.guard.call(lambda: self._put(keys=self._entry_keys(key), args=args), None)
        return []  # the last shared tier: evicted blocks are dropped

    def contains(self, key: str) -> bool:
        """True if `key` holds a value that passes verification. One round trip (its length and first
        bytes) for a value verified here before; any other value is read and verified in full, and
        deleted if it fails. Never marks the entry as used."""
        blob_key = self._blob_key(key)

        def head() -> tuple[int, bytes]:
            pipe = self.client.pipeline(transaction=True)
            pipe.strlen(blob_key)
            pipe.getrange(blob_key, 0, HEAD_BYTES - 1)
            length, first = pipe.execute()
            return length, first

        length, first = self.guard.call(head, (0, b""))
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
