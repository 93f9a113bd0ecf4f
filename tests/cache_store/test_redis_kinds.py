"""The Redis tier with kinds, against a real redis-server: prefix-first LRU, pins, TTLs, shared index."""

from __future__ import annotations

import time

import torch

from promptcache.cache_store import KVBlock, RedisTier, dumps


def blk(tokens: int = 4, fill: float = 1.0) -> KVBlock:
    keys = torch.full((2, 2, tokens, 8), fill)
    return KVBlock(keys, keys * 2, torch.arange(tokens))


SIZE = len(dumps(blk(), "x"))  # the blob size does not depend on the key


def tier_for(url: str, entries: int, namespace: str = "k") -> RedisTier:
    return RedisTier(url, max_bytes=entries * SIZE + 10, namespace=namespace)


def test_prefix_entries_are_evicted_before_modules_each_in_lru_order(redis_server):
    tier = tier_for(redis_server.url, 4)
    tier.put("m1", blk())
    tier.put("p1", blk(), kind="prefix")
    tier.put("m2", blk())
    tier.put("p2", blk(), kind="prefix")
    tier.get("p1")  # p2 is now the least recently used prefix entry
    tier.get("m1")  # m2 is now the least recently used module entry
    tier.put("m3", blk())
    assert sorted(tier.keys()) == ["m1", "m2", "m3", "p1"]
    tier.put("m4", blk())
    assert sorted(tier.keys()) == ["m1", "m2", "m3", "m4"]
    tier.put("m5", blk())
    assert sorted(tier.keys()) == ["m1", "m3", "m4", "m5"]
    tier.put("p3", blk(), kind="prefix")  # the entry being written is never its own victim
    assert sorted(tier.keys()) == ["m3", "m4", "m5", "p3"] and tier.used_bytes <= tier.max_bytes
    assert tier.get("m2") is None and tier.lookup("p3").kind == "prefix"


def test_reads_keep_the_kind_and_a_re_put_never_downgrades_a_module(redis_server):
    tier = tier_for(redis_server.url, 10)
    tier.put("p", blk(), kind="prefix")
    for _ in range(3):
        assert tier.lookup("p").kind == "prefix"  # touching it re-scores it inside its kind
    tier.put("m", blk())
    tier.put("m", blk(), kind="prefix")
    assert tier.lookup("m").kind == "module"
    tier.put("p", blk())  # prefix -> module is an upgrade
    assert tier.lookup("p").kind == "module" and tier.usage().prefix_bytes == 0


def test_pinned_prefix_entries_survive(redis_server):
    tier = tier_for(redis_server.url, 3)
    tier.put("kept", blk(), kind="prefix", pinned=True)
    tier.put("p", blk(), kind="prefix")
    tier.put("m1", blk())
    tier.put("m2", blk())
    assert sorted(tier.keys()) == ["kept", "m1", "m2"]
    tier.put("m3", blk())
    assert sorted(tier.keys()) == ["kept", "m2", "m3"]
    tier.unpin("kept")
    tier.put("m4", blk())
    assert sorted(tier.keys()) == ["m2", "m3", "m4"]


def test_byte_counters_by_kind_follow_puts_evictions_and_deletes(redis_server):
    tier = tier_for(redis_server.url, 3)
    tier.put("p1", blk(), kind="prefix")
    tier.put("p2", blk(), kind="prefix")
    tier.put("m1", blk())
    assert tier.usage() == (3 * SIZE, 3, 2 * SIZE, 0)
    tier.put("m2", blk())  # evicts p1
    assert tier.usage() == (3 * SIZE, 3, SIZE, 0)
    assert tier.delete("p2") and not tier.delete("p2")
    assert tier.usage() == (2 * SIZE, 2, 0, 0)


def test_ttl_with_kinds(redis_server):
    tier = tier_for(redis_server.url, 10)
    tier.put("brief", blk(), kind="prefix", ttl_s=0.2)
    hit = tier.lookup("brief")
    assert hit.kind == "prefix" and 0 < hit.ttl_s <= 0.2
    assert tier.lookup("forever") is None
    tier.put("forever", blk())
    assert tier.lookup("forever").ttl_s is None
    time.sleep(0.35)
    assert tier.lookup("brief") is None and tier.contains("forever")


def test_replicas_share_one_eviction_order(redis_server):
    one, two = tier_for(redis_server.url, 3, "shared"), tier_for(redis_server.url, 3, "shared")
    one.put("m1", blk())
    two.put("p1", blk(), kind="prefix")
    one.put("m2", blk())
    two.get("m1")
    one.put("m3", blk())  # p1 goes first although another replica wrote it
    assert sorted(two.keys()) == ["m1", "m2", "m3"]
    two.put("m4", blk())  # then the LRU module: m2 (m1 was read by the other replica)
    assert sorted(one.keys()) == ["m1", "m3", "m4"] and one.used_bytes == 3 * SIZE
