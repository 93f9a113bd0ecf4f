"""The Redis tier and schema registry against a real redis-server: sharing, budgets, outages."""

from __future__ import annotations

import logging
import time

import pytest
import redis
import torch

from promptcache.cache_store import (
    KVBlock,
    MemoryTier,
    RedisTier,
    SchemaExistsError,
    SchemaRegistry,
    StoreConfig,
    TieredStore,
    build_store,
    dumps,
)


def blk(tokens: int, fill: float = 1.0, dtype=torch.float32) -> KVBlock:
    keys = torch.full((2, 2, tokens, 8), fill).to(dtype)
    return KVBlock(keys, keys * 2, torch.arange(tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_through_redis(redis_server, dtype):
    tier = RedisTier(redis_server.url, max_bytes=1 << 20, namespace="t")
    original = blk(5, 1.5, dtype)
    tier.put("k1", original)
    copy = tier.get("k1")
    assert copy is not None and copy.dtype == dtype and torch.equal(copy.values, original.values)


def test_redis_budget_lru_and_pins(redis_server):
    size = len(dumps(blk(4), "x" * 64))
    tier = RedisTier(redis_server.url, max_bytes=3 * size + 10, namespace="t")
    tier.put("a", blk(4), pinned=True)
    tier.put("b", blk(4))
    tier.put("c", blk(4))
    tier.get("b")
    tier.put("d", blk(4))  # over budget: c is the least recently used unpinned entry
    assert sorted(tier.keys()) == ["a", "b", "d"] and tier.used_bytes <= tier.max_bytes
    assert tier.get("c") is None and tier.get("a") is not None


def test_redis_ttl(redis_server):
    tier = RedisTier(redis_server.url, max_bytes=1 << 20, namespace="t")
    tier.put("brief", blk(2), ttl_s=0.15)
    assert tier.get("brief") is not None
    time.sleep(0.3)
    assert tier.get("brief") is None


def test_corrupted_value_in_redis_is_a_miss(redis_server, caplog):
    tier = RedisTier(redis_server.url, max_bytes=1 << 20, namespace="t")
    tier.put("k", blk(3))
    client = redis.Redis.from_url(redis_server.url)
    raw = bytearray(client.get("promptcache:t:kv:k"))
    raw[-1] ^= 0xFF
    client.set("promptcache:t:kv:k", bytes(raw))
    with caplog.at_level(logging.WARNING):
        assert tier.get("k") is None
    assert "corrupted" in caplog.text and not tier.contains("k")


def test_outage_is_a_miss_and_recovery_uses_redis_again(redis_server, caplog):
    store = build_store(StoreConfig(device_max_bytes=1 << 20, redis_url=redis_server.url, redis_namespace="o",
                                    redis_timeout_s=0.2, redis_retry_interval_s=0.3))
    redis_tier = store.tiers[-1]
    redis_tier.put("shared", blk(2))
    redis_server.stop()
    with caplog.at_level(logging.WARNING):
        started = time.monotonic()
        assert redis_tier.get("shared") is None
        store.put("new", blk(2))            # write-through fails quietly
        assert store.get("missing") is None
        assert time.monotonic() - started < 1.5  # bounded by the timeout, then the back-off skips Redis
    assert "unavailable" in caplog.text
    assert store.get("new")[1] == "device"
    redis_server.start()
    time.sleep(0.35)  # past the retry interval
    store.put("after", blk(2))
    assert store.flush(timeout_s=5)  # the shared write is queued behind put
    assert redis_tier.get("after") is not None


def test_two_replicas_share_blocks_and_schemas(redis_server):
    one = build_store(StoreConfig(redis_url=redis_server.url, redis_namespace="r"))
    two = build_store(StoreConfig(redis_url=redis_server.url, redis_namespace="r"))
    one.put("module", blk(3, 7.0))
    assert one.flush(timeout_s=5)
    got = two.get("module")
    assert got is not None and got[1] == "redis" and float(got[0].keys.flatten()[0]) == 7.0
    assert two.get("module")[1] == "device"
    other_namespace = build_store(StoreConfig(redis_url=redis_server.url, redis_namespace="elsewhere"))
    assert other_namespace.get("module") is None

    first = SchemaRegistry(redis_server.url, namespace="r")
    first.save("docs", "<schema name='docs'/>", {"num_tokens": 3})
    with pytest.raises(SchemaExistsError):
        SchemaRegistry(redis_server.url, namespace="r").save("docs", "<schema name='docs'/>")
    del first
    restarted = SchemaRegistry(redis_server.url, namespace="r")
    stored = restarted.load("docs")
    assert stored is not None and stored.metadata == {"num_tokens": 3}
    assert [s.name for s in restarted.list()] == ["docs"]
    assert restarted.delete("docs") and SchemaRegistry(redis_server.url, namespace="r").load("docs") is None


def test_store_without_shared_tier_has_demotion_chain():
    store = TieredStore([MemoryTier("device", blk(2).nbytes), MemoryTier("host", 4 * blk(2).nbytes)])
    store.put("a", blk(2))
    store.put("b", blk(2))
    assert store.tier_of("a").name == "host" and store.tier_of("b").name == "device"
