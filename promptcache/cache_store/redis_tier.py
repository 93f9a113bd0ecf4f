"""The shared tier: KV blocks in Redis, visible to every replica and surviving restarts.

Keys live under `promptcache:<namespace>:`. The byte budget is enforced by an LRU index kept in Redis:
a sorted set ranking entries by last use, a hash of sizes, byte counters (all, and prefix entries), a set
of pinned keys and a use counter. Writes, reads and deletes each run as one Lua script, so replicas
sharing the server see one consistent index.

Scores are a shared use counter (not wall-clock time, so replicas with skewed clocks still agree), plus
`MODULE_SCORE_OFFSET` for "module" entries: every "prefix" entry ranks below every "module" entry, so
eviction (lowest score first) takes prefix entries first, each kind in LRU order, and the kind of an
entry is read back from its score.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.errors import CacheStoreError
from promptcache.cache_store.redis_guard import RedisGuard, logger
from promptcache.cache_store.serialization import dumps, loads
from promptcache.cache_store.signing import BlobSigner
from promptcache.cache_store.tier import BlockKind, Tier, TierHit, TierUsage

MODULE_SCORE_OFFSET = 10**15  # above any use count; scores stay exact integers in a double (< 2**53)
_PRELUDE = f"local OFFSET = {MODULE_SCORE_OFFSET}\n"

# KEYS: blob, lru, sizes, pins, total, prefix_total, seq. ARGV: member, blob, ttl_ms (0: none), pinned (0/1),
# kind, max_bytes, blob key prefix. Returns the evicted members.
_PUT = _PRELUDE + """
local lru, sizes, pins = KEYS[2], KEYS[3], KEYS[4]
local member, blob, ttl_ms, kind = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[5]
local max, kv = tonumber(ARGV[6]), ARGV[7]
local total = tonumber(redis.call('GET', KEYS[5]) or '0')
local prefix_total = tonumber(redis.call('GET', KEYS[6]) or '0')
local old_score = redis.call('ZSCORE', lru, member)
local old_size = tonumber(redis.call('HGET', sizes, member) or '0')
if old_score then
  if tonumber(old_score) >= OFFSET then kind = 'module' else prefix_total = prefix_total - old_size end
end
if ttl_ms > 0 then redis.call('SET', KEYS[1], blob, 'PX', ttl_ms) else redis.call('SET', KEYS[1], blob) end
local size = string.len(blob)
local score = redis.call('INCR', KEYS[7])
if kind == 'module' then score = score + OFFSET else prefix_total = prefix_total + size end
redis.call('HSET', sizes, member, size)
redis.call('ZADD', lru, string.format('%.0f', score), member)
if ARGV[4] == '1' then redis.call('SADD', pins, member) end
total = total - old_size + size
-- Evict lowest scores first, skipping pins and the entry just written. `rank` counts skipped entries,
-- which is where the next unvisited entry sits once the removed ones are gone.
local evicted, rank = {}, 0
while total > max do
  local batch = redis.call('ZRANGE', lru, rank, rank + 63, 'WITHSCORES')
  if #batch == 0 then break end
  for i = 1, #batch, 2 do
    if total <= max then break end
    local k = batch[i]
    if k == member or redis.call('SISMEMBER', pins, k) == 1 then
      rank = rank + 1
    else
      local s = tonumber(redis.call('HGET', sizes, k) or '0')
      total = total - s
      if tonumber(batch[i + 1]) < OFFSET then prefix_total = prefix_total - s end
      redis.call('DEL', kv .. k)
      redis.call('HDEL', sizes, k)
      redis.call('ZREM', lru, k)
      table.insert(evicted, k)
    end
  end
end
redis.call('SET', KEYS[5], string.format('%.0f', total))
redis.call('SET', KEYS[6], string.format('%.0f', prefix_total))
return evicted
"""

# KEYS: blob, lru, seq. ARGV: member. Returns {blob, kind, pttl_ms} and marks the entry as just used
# (keeping its kind), or nil.
_GET = _PRELUDE + """
local blob = redis.call('GET', KEYS[1])
if not blob then return false end
local kind, score = 'module', redis.call('ZSCORE', KEYS[2], ARGV[1])
if score then
  local seq = redis.call('INCR', KEYS[3])
  if tonumber(score) < OFFSET then kind = 'prefix' else seq = seq + OFFSET end
  redis.call('ZADD', KEYS[2], string.format('%.0f', seq), ARGV[1])
end
return {blob, kind, redis.call('PTTL', KEYS[1])}
"""

# KEYS: blob, lru, sizes, pins, total, prefix_total. ARGV: member. Returns 1 if the blob existed.
_DELETE = _PRELUDE + """
local existed = redis.call('DEL', KEYS[1])
local size = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if score and tonumber(score) < OFFSET then redis.call('DECRBY', KEYS[6], size) end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
redis.call('DECRBY', KEYS[5], size)
return existed
"""


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
    every blob carries an HMAC; one that fails the check is a miss (signing.py).

    `url` may be `redis://`, `rediss://` (TLS; `?ssl_ca_certs=...&ssl_cert_reqs=...` as redis-py
    parses them) and may carry an ACL user and password (`redis://user:password@host:port/db`).
    """

    is_shared = True

    def __init__(self, url: str, *, max_bytes: int, namespace: str = "default", timeout_s: float = 0.5,
                 retry_interval_s: float = 2.0, name: str = "redis", signer: BlobSigner | None = None) -> None:
        self.name = name
        self.signer = signer or BlobSigner()
        self.max_bytes = max_bytes
        self.prefix = f"promptcache:{namespace}:"
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.guard = RedisGuard(f"Redis tier at {redacted(url)}", retry_interval_s)
        self._put = self.client.register_script(_PUT)
        self._get = self.client.register_script(_GET)
        self._delete = self.client.register_script(_DELETE)
        self._lru, self._sizes, self._pins, self._total, self._prefix_total, self._seq = (
            self.prefix + s for s in ("lru", "size", "pins", "bytes", "prefix_bytes", "seq"))

    def _blob_key(self, key: str) -> str:
        return f"{self.prefix}kv:{key}"

    def get(self, key: str) -> KVBlock | None:
        hit = self.lookup(key)
        return None if hit is None else hit.block

    def lookup(self, key: str) -> TierHit | None:
        reply = self.guard.call(lambda: self._get(keys=[self._blob_key(key), self._lru, self._seq], args=[key]),
                                None)
        if reply is None:
            return None
        sealed, kind, ttl_ms = reply
        data = self.signer.open(self._blob_key(key), sealed)
        if data is None:  # forged or altered (logged): a miss; a rightful put overwrites it
            return None
        try:
            block = loads(data, expect_key=key)
        except CacheStoreError as exc:
            logger.warning("dropping corrupted KV block %s from Redis: %s", key[:12], exc)
            self.delete(key)
            return None
        kind = kind.decode() if isinstance(kind, bytes) else kind
        return TierHit(block, kind, None if ttl_ms < 0 else ttl_ms / 1000)

    def put(self, key: str, block: KVBlock, *, pinned: bool = False, ttl_s: float | None = None,
            kind: BlockKind = "module") -> list[tuple[str, KVBlock]]:
        blob = self.signer.seal(self._blob_key(key), dumps(block, key))
        if len(blob) > self.max_bytes:
            return []
        ttl_ms = 0 if ttl_s is None else max(1, int(ttl_s * 1000))
        keys = [self._blob_key(key), self._lru, self._sizes, self._pins, self._total, self._prefix_total, self._seq]
        args = [key, blob, ttl_ms, int(pinned), kind, self.max_bytes, self.prefix + "kv:"]
        self.guard.call(lambda: self._put(keys=keys, args=args), None)
        return []  # the last shared tier: evicted blocks are dropped

    def contains(self, key: str) -> bool:
        return bool(self.guard.call(lambda: self.client.exists(self._blob_key(key)), 0))

    def delete(self, key: str) -> bool:
        keys = [self._blob_key(key), self._lru, self._sizes, self._pins, self._total, self._prefix_total]
        return bool(self.guard.call(lambda: self._delete(keys=keys, args=[key]), 0))

    def pin(self, key: str) -> bool:
        return bool(self.guard.call(lambda: self.client.sadd(self._pins, key), 0)) or self.contains(key)

    def unpin(self, key: str) -> bool:
        return bool(self.guard.call(lambda: self.client.srem(self._pins, key), 0))

    @property
    def used_bytes(self) -> int:
        return int(self.guard.call(lambda: self.client.get(self._total), None) or 0)

    def keys(self) -> list[str]:
        raw = self.guard.call(lambda: self.client.zrange(self._lru, 0, -1), [])
        return [k.decode() if isinstance(k, bytes) else k for k in raw]

    def usage(self) -> TierUsage:
        def read() -> TierUsage:
            total, prefix, count = self.client.pipeline(transaction=False).get(self._total).get(
                self._prefix_total).zcard(self._lru).execute()
            return TierUsage(int(total or 0), int(count), int(prefix or 0))

        return self.guard.call(read, TierUsage(0, 0))
