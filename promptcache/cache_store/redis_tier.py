"""The shared tier: KV blocks in Redis, visible to every replica and surviving restarts.

Keys live under `promptcache:<namespace>:`. The byte budget is enforced by an LRU index kept in Redis
(sorted set of last use, hash of sizes, a byte counter, a set of pinned keys); eviction runs as one
Lua script so replicas sharing the server stay consistent.
"""

from __future__ import annotations

import time

import redis

from promptcache.cache_store.block import KVBlock
from promptcache.cache_store.errors import CacheStoreError
from promptcache.cache_store.redis_guard import RedisGuard, logger
from promptcache.cache_store.serialization import dumps, loads
from promptcache.cache_store.tier import Tier

_EVICT = """
local lru, sizes, pins, total_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local max, prefix = tonumber(ARGV[1]), ARGV[2]
local total = tonumber(redis.call('GET', total_key) or '0')
local evicted, rank = {}, 0
while total > max do
  local batch = redis.call('ZRANGE', lru, rank, rank)
  if #batch == 0 then break end
  local k = batch[1]
  if redis.call('SISMEMBER', pins, k) == 1 then
    rank = rank + 1
  else
    total = total - tonumber(redis.call('HGET', sizes, k) or '0')
    redis.call('DEL', prefix .. k)
    redis.call('HDEL', sizes, k)
    redis.call('ZREM', lru, k)
    table.insert(evicted, k)
  end
end
redis.call('SET', total_key, total)
return evicted
"""


class RedisTier(Tier):
    """KV blocks serialized into Redis under a byte budget. Redis failures are misses, never errors."""

    is_shared = True

    def __init__(self, url: str, *, max_bytes: int, namespace: str = "default", timeout_s: float = 0.5,
                 retry_interval_s: float = 2.0, name: str = "redis") -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.prefix = f"promptcache:{namespace}:"
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.guard = RedisGuard(f"Redis tier at {url}", retry_interval_s)
        self._evict = self.client.register_script(_EVICT)
        self._index = [self.prefix + s for s in ("lru", "size", "pins", "bytes")]

    def _blob_key(self, key: str) -> str:
        return f"{self.prefix}kv:{key}"

    def get(self, key: str) -> KVBlock | None:
        data = self.guard.call(lambda: self.client.get(self._blob_key(key)), None)
        if data is None:
            return None
        try:
            block = loads(data, expect_key=key)
        except CacheStoreError as exc:
            logger.warning("dropping corrupted KV block %s from Redis: %s", key[:12], exc)
            self.delete(key)
            return None
        self.guard.call(lambda: self.client.zadd(self._index[0], {key: time.time()}), None)
        return block

    def put(self, key: str, block: KVBlock, *, pinned: bool = False,
            ttl_s: float | None = None) -> list[tuple[str, KVBlock]]:
        blob = dumps(block, key)
        if len(blob) > self.max_bytes:
            return []

        def write() -> None:
            lru, sizes, pins, total = self._index
            old = self.client.hget(sizes, key)
            pipe = self.client.pipeline(transaction=True)
            pipe.set(self._blob_key(key), blob, px=None if ttl_s is None else max(1, int(ttl_s * 1000)))
            pipe.hset(sizes, key, len(blob))
            pipe.zadd(lru, {key: time.time()})
            pipe.incrby(total, len(blob) - int(old or 0))
            if pinned:
                pipe.sadd(pins, key)
            pipe.execute()
            self._evict(keys=self._index, args=[self.max_bytes, self.prefix + "kv:"])

        self.guard.call(write, None)
        return []  # the last shared tier: evicted blocks are dropped

    def contains(self, key: str) -> bool:
        return bool(self.guard.call(lambda: self.client.exists(self._blob_key(key)), 0))

    def delete(self, key: str) -> bool:
        def remove() -> bool:
            lru, sizes, pins, total = self._index
            size = int(self.client.hget(sizes, key) or 0)
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self._blob_key(key))
            pipe.hdel(sizes, key)
            pipe.zrem(lru, key)
            pipe.srem(pins, key)
            pipe.decrby(total, size)
            return bool(pipe.execute()[0])

        return self.guard.call(remove, False)

    def pin(self, key: str) -> bool:
        return bool(self.guard.call(lambda: self.client.sadd(self._index[2], key), 0)) or self.contains(key)

    def unpin(self, key: str) -> bool:
        return bool(self.guard.call(lambda: self.client.srem(self._index[2], key), 0))

    @property
    def used_bytes(self) -> int:
        return int(self.guard.call(lambda: self.client.get(self._index[3]), None) or 0)

    def keys(self) -> list[str]:
        raw = self.guard.call(lambda: self.client.zrange(self._index[0], 0, -1), [])
        return [k.decode() if isinstance(k, bytes) else k for k in raw]
