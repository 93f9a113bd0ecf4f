"""Memory tier and TieredStore: LRU, pins, TTL, promotion/demotion, budgets under random operations."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from promptcache.cache_store import CapacityError, KVBlock, MemoryTier, TieredStore


def blk(tokens: int, fill: float = 0.0) -> KVBlock:
    keys = torch.full((1, 1, tokens, 4), fill)
    return KVBlock(keys, keys + 1, torch.arange(tokens))


SIZE = blk(1).nbytes  # bytes per 1-token block (40: 2 x 16 floats + 8 position bytes)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lru_evicts_least_recently_used():
    tier = MemoryTier("t", 3 * SIZE)
    for k in "abc":
        tier.put(k, blk(1))
    tier.get("a")  # refresh a: b is now the oldest
    evicted = tier.put("d", blk(1))
    assert [k for k, _ in evicted] == ["b"] and sorted(tier.keys()) == ["a", "c", "d"]
    assert tier.used_bytes == 3 * SIZE


def test_pins_are_never_evicted_and_capacity_error_when_only_pins_remain():
    tier = MemoryTier("t", 2 * SIZE)
    tier.put("a", blk(1), pinned=True)
    tier.put("b", blk(1))
    assert [k for k, _ in tier.put("c", blk(1))] == ["b"]
    tier.pin("c")
    with pytest.raises(CapacityError, match="pinned"):
        tier.put("d", blk(1))
    assert sorted(tier.keys()) == ["a", "c"] and tier.used_bytes == 2 * SIZE
    tier.unpin("c")
    assert [k for k, _ in tier.put("d", blk(1))] == ["c"]


def test_ttl_expires_entries():
    clock = FakeClock()
    tier = MemoryTier("t", 10 * SIZE, clock=clock)
    tier.put("short", blk(1), ttl_s=1.0)
    tier.put("long", blk(1))
    clock.now = 0.5
    assert tier.get("short") is not None
    clock.now = 1.5
    assert tier.get("short") is None and not tier.contains("short") and tier.get("long") is not None
    assert tier.used_bytes == SIZE


def test_promotion_and_demotion_report_the_tier():
    device, host = MemoryTier("device", 2 * SIZE), MemoryTier("host", 10 * SIZE)
    store = TieredStore([device, host])
    for k in "abc":
        store.put(k, blk(1, fill=ord(k)))
    assert store.tier_of("a").name == "host"  # evicted from device, demoted, not lost
    block, tier = store.get("a")
    assert tier == "host" and float(block.keys[0, 0, 0, 0]) == ord("a")
    assert store.get("a")[1] == "device"  # promoted on the first hit
    stats = {t.name: t for t in store.stats().tiers}
    assert stats["device"].evictions >= 2 and stats["host"].hits == 1 and stats["host"].promotions == 1


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get", "pin", "delete"]), st.integers(0, 7),
                          st.integers(1, 4)), max_size=60))
def test_budgets_hold_under_random_operations(ops):
    tiers = [MemoryTier("device", 6 * SIZE), MemoryTier("host", 12 * SIZE)]
    store = TieredStore(tiers)
    truth: dict[str, float] = {}
    for op, key_id, tokens in ops:
        key = f"k{key_id}"
        if op == "put":
            try:
                store.put(key, blk(tokens, fill=key_id * 10 + tokens))
                truth[key] = key_id * 10 + tokens
            except CapacityError:
                pass
        elif op == "get":
            got = store.get(key)
            if got is not None:
                assert float(got[0].keys.flatten()[0]) == truth[key]  # never another key's data
        elif op == "pin":
            store.pin(key)
        else:
            store.delete(key)
            truth.pop(key, None)
        for tier in tiers:
            assert tier.used_bytes <= tier.max_bytes
            assert tier.used_bytes == sum(tier.get(k).nbytes for k in tier.keys() if tier.contains(k))  # noqa: SIM118 (a Tier, not a dict)


def test_thread_safety_counters_add_up():
    store = TieredStore([MemoryTier("device", 8 * SIZE), MemoryTier("host", 32 * SIZE)])
    gets_per_thread = 300

    def worker(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for i in range(gets_per_thread):
            key = f"k{int(torch.randint(0, 20, (1,), generator=g))}"
            store.put(key, blk(1)) if i % 3 == 0 else None
            store.get(key)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = store.stats()
    assert stats.num_gets == 4 * gets_per_thread
    device = stats.tiers[0]
    hits = sum(t.hits for t in stats.tiers)
    assert hits + stats.tiers[-1].misses == stats.num_gets  # every get ends in a hit or a last-tier miss
    assert device.used_bytes <= device.max_bytes


def test_fetch_policy_skips_a_tier_slower_than_recompute():
    from promptcache.cache_store import FetchPolicy

    policy = FetchPolicy()
    assert policy.worth_fetching("redis", 10**6, 100)  # nothing measured yet: fetch
    policy.record_fetch("redis", 10**6, 1.0)             # 1 MB/s
    policy.record_recompute(1000, 0.1)                   # 10k tokens/s
    assert not policy.worth_fetching("redis", 10**6, 100)  # 1 s to fetch vs 0.01 s to recompute
    assert policy.worth_fetching("redis", 10**3, 100)      # 1 ms vs 10 ms

    class SlowShared(MemoryTier):
        is_shared = True

    shared = SlowShared("redis", 100 * SIZE)
    store = TieredStore([MemoryTier("device", 10 * SIZE), shared], policy=policy)
    shared.put("k", blk(1))
    assert store.get("k", num_tokens=1, nbytes=10**6) is None  # skipped: recompute is cheaper
    assert store.get("k", num_tokens=1000, nbytes=10**3) is not None


def test_a_put_for_others_goes_to_the_shared_tiers_only(tmp_path):
    from promptcache.cache_store import DiskTier

    device = MemoryTier("device", 10 * SIZE)
    store = TieredStore([device, DiskTier(tmp_path, max_bytes=1 << 20)])
    store.put("mine", blk(1, 1.0))
    store.put("theirs", blk(1, 2.0), local=False)
    assert store.flush(10)
    assert device.keys() == ["mine"] and store.tier_of("theirs").name == "disk"
    block, tier = store.get("theirs", promote=False)  # read for others again: still not kept here
    assert tier == "disk" and torch.equal(block.keys, blk(1, 2.0).keys) and not device.contains("theirs")
    block, tier = store.get("theirs")  # a use here fetches it and promotes it like any other block
    assert tier == "disk" and torch.equal(block.keys, blk(1, 2.0).keys) and device.contains("theirs")
    alone = TieredStore([MemoryTier("device", 10 * SIZE)])  # no shared tier: kept here, never lost
    alone.put("theirs", blk(1), local=False)
    assert alone.tier_of("theirs").name == "device"
