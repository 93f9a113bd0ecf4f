"""The Redis tier on a Redis at its maxmemory with `noeviction` (as deployed): writes make room before they
write, so a full Redis keeps taking KV and, once a write has shrunk the tier, the schema registry's writes."""

from __future__ import annotations

import logging
import time

import pytest
import redis
import torch

from promptcache.cache_store import KVBlock, RedisTier, RegistryUnavailableError, SchemaRegistry

BLOCK_TOKENS = 1600  # ~200 KB serialized: a few fill the room a test Redis gets


def blk(fill: float) -> KVBlock:
    keys = torch.full((2, 2, BLOCK_TOKENS, 8), float(fill))
    return KVBlock(keys, keys * 2, torch.arange(BLOCK_TOKENS))


def fill_with_others(client: redis.Redis, over_bytes: int) -> None:
    """Someone else's keys until Redis refuses one; then its limit drops `over_bytes` below what it holds (buffers
    settled), so it refuses every write that may grow memory, however small."""
    for n in range(10_000):
        try:
            client.set(f"other{n}", b"y" * 20_000)
        except redis.exceptions.OutOfMemoryError:
            time.sleep(0.3)  # the refused command's buffer is trimmed by Redis' cron
            client.config_set("maxmemory", client.info("memory")["used_memory"] - over_bytes)
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                client.set("probe", b"x")
            return
    raise AssertionError("Redis never filled up")


@pytest.fixture
def tight_redis(redis_server):
    """The test's Redis with ~2 MB above what it uses empty, refusing writes past that (noeviction)."""
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", client.info("memory")["used_memory"] + (2 << 20))
    return redis_server


def test_a_full_redis_keeps_accepting_writes(tight_redis):
    client = redis.Redis.from_url(tight_redis.url)
    # A budget above Redis' own limit (what compose had: both 8 GB): Redis fills before the tier's LRU evicts.
    tier = RedisTier(tight_redis.url, max_bytes=64 << 20, namespace="t")
    registry = SchemaRegistry(tight_redis.url, namespace="t")
    for i in range(40):
        tier.put(f"k{i}", blk(i))
        copy = tier.get(f"k{i}")  # read back at once; it also marks the entry used, which must not fail either
        assert copy is not None and torch.equal(copy.keys, blk(i).keys), f"write {i} was lost"
    # Redis' limit, not the budget, bounded the tier: it evicted while far below its 64 MB budget.
    held = tier.keys()
    assert tier.used_bytes < 4 << 20 and len(held) < 10
    assert tier.used_bytes == sum(int(client.hget("promptcache:t:size", k)) for k in held)
    # Someone else's keys fill Redis to its limit; the tier's next write evicts two blobs' worth.
    fill_with_others(client, over_bytes=128 << 10)
    with pytest.raises(RegistryUnavailableError):
        registry.save("while-full", "<schema name='s'>x</schema>")
    tier.put("last", blk(0.5))
    assert tier.get("last") is not None
    # A write into a full Redis leaves it a blob's size (~400 KB) below where it found it: the registry can write
    # again once Redis has trimmed the buffer the write arrived in (its cron, within ~0.1-0.2 s).
    deadline = time.monotonic() + 3
    while True:
        try:
            assert registry.save("after-full", "<schema name='s'>x</schema>").name == "after-full"
            break
        except RegistryUnavailableError:
            assert time.monotonic() < deadline, "the registry stayed refused"
            time.sleep(0.1)


def test_a_redis_full_of_other_data_skips_the_write_and_keeps_reading(tight_redis, caplog):
    client = redis.Redis.from_url(tight_redis.url)
    tier = RedisTier(tight_redis.url, max_bytes=64 << 20, namespace="t")
    tier.put("kept", blk(1.0), pinned=True)
    fill_with_others(client, over_bytes=1 << 20)  # nothing of the tier's to evict: "kept" is pinned
    with caplog.at_level(logging.WARNING):
        tier.put("new", blk(2.0))
    assert "is full (maxmemory)" in caplog.text
    assert tier.get("new") is None and tier.get("kept") is not None  # skipped, not an outage: reads go on
    assert tier.keys() == ["kept"] and tier.used_bytes == int(client.hget("promptcache:t:size", "kept"))


def test_a_full_redis_still_deletes_schemas(tight_redis):
    registry = SchemaRegistry(tight_redis.url, namespace="t")
    registry.save("doomed", "<schema name='doomed'>x</schema>")
    fill_with_others(redis.Redis.from_url(tight_redis.url), over_bytes=1 << 20)
    assert registry.delete("doomed")  # frees memory: a full Redis must take it (a MULTI was refused: a 503)
    state = registry.state()
    assert registry.load("doomed") is None and state is not None and "doomed" in state.deleted
    assert "doomed" not in state.versions
