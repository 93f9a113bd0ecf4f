"""MemoryTier and TieredStore (in-process tiers): kinds, LRU per kind, pins, refcounts, speed."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from promptcache.cache_store import CapacityError, KVBlock, MemoryTier, TieredStore


def blk(tokens: int = 1, fill: float = 0.0) -> KVBlock:
    keys = torch.full((1, 1, tokens, 4), fill)
    return KVBlock(keys, keys + 1, torch.arange(tokens))


SIZE = blk().nbytes


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def evicted_keys(evicted) -> list[str]:
    return [key for key, _ in evicted]


def test_prefix_entries_are_evicted_before_modules_each_in_lru_order():
    tier = MemoryTier("t", 4 * SIZE)
    tier.put("m1", blk())
    tier.put("p1", blk(), kind="prefix")
    tier.put("m2", blk())
    tier.put("p2", blk(), kind="prefix")
    tier.get("p1")  # p2 is now the least recently used prefix entry
    tier.get("m1")  # m2 is now the least recently used module entry
    assert evicted_keys(tier.put("m3", blk())) == ["p2"]
    assert evicted_keys(tier.put("m4", blk())) == ["p1"]
    assert evicted_keys(tier.put("m5", blk())) == ["m2"]  # no prefix left: LRU among modules
    assert evicted_keys(tier.put("p3", blk(), kind="prefix")) == ["m1"]  # the new entry is never its own victim
    assert evicted_keys(tier.put("m6", blk())) == ["p3"]


def test_evictions_carry_kind_and_remaining_ttl():
    clock = FakeClock()
    tier = MemoryTier("t", 2 * SIZE, clock=clock)
    tier.put("p", blk(), kind="prefix", ttl_s=10.0)
    tier.put("m", blk())
    clock.now = 4.0
    (victim,) = tier.put("n", blk())
    assert (victim.key, victim.kind, victim.ttl_s) == ("p", "prefix", 6.0)
    (victim,) = tier.put("o", blk())
    assert (victim.key, victim.kind, victim.ttl_s) == ("m", "module", None)


def test_expired_entries_are_evicted_but_not_returned_for_demotion():
    clock = FakeClock()
    tier = MemoryTier("t", 2 * SIZE, clock=clock)
    tier.put("brief", blk(), kind="prefix", ttl_s=1.0)
    tier.put("m", blk())
    clock.now = 2.0
    assert tier.put("n", blk()) == [] and sorted(tier.keys()) == ["m", "n"]


def test_pinned_and_acquired_entries_survive_pressure_until_released():
    tier = MemoryTier("t", 3 * SIZE)
    tier.put("held", blk(), kind="prefix")
    tier.acquire("held")
    tier.put("pinned", blk(), kind="prefix", pinned=True)
    tier.put("m1", blk())
    assert evicted_keys(tier.put("m2", blk())) == ["m1"]  # the prefix entries are protected
    assert tier.usage().num_referenced == 1
    tier.acquire("m2")
    with pytest.raises(CapacityError, match="pinned or referenced"):
        tier.put("m3", blk())
    tier.release("m2")
    tier.release("held")
    assert evicted_keys(tier.put("m4", blk())) == ["held"]  # released: a prefix entry again goes first
    tier.unpin("pinned")
    assert evicted_keys(tier.put("m5", blk())) == ["pinned"]


def test_refcounts_never_go_negative_and_survive_a_re_put():
    tier = MemoryTier("t", 2 * SIZE)
    tier.release("never-acquired")  # no error
    tier.put("a", blk(), kind="prefix")
    tier.acquire("a")
    tier.release("a")
    tier.release("a")  # one more release than acquires: stays at zero
    tier.acquire("a")  # so this makes it referenced again
    tier.put("a", blk(fill=2.0), kind="prefix")  # a re-put keeps the refcount
    tier.put("b", blk())
    assert evicted_keys(tier.put("c", blk())) == ["b"]
    tier.release("a")
    assert evicted_keys(tier.put("d", blk())) == ["a"]
    assert tier.usage().num_referenced == 0


def test_a_re_put_keeps_module_kind_and_pin():
    tier = MemoryTier("t", 3 * SIZE)
    tier.put("shared", blk(), pinned=True)
    tier.put("shared", blk(), kind="prefix")
    hit = tier.lookup("shared")
    assert hit.kind == "module"
    tier.put("p", blk(), kind="prefix")
    tier.put("p", blk())  # prefix -> module is an upgrade
    assert tier.lookup("p").kind == "module" and tier.usage().prefix_bytes == 0
    tier.put("x", blk())
    assert evicted_keys(tier.put("y", blk())) == ["p"]  # "shared" is still pinned


def test_byte_accounting_by_kind():
    tier = MemoryTier("t", 10 * SIZE)
    tier.put("p", blk(2), kind="prefix")
    tier.put("m", blk(3))
    usage = tier.usage()
    assert (usage.used_bytes, usage.num_entries, usage.prefix_bytes) == (tier.used_bytes, 2, blk(2).nbytes)
    tier.delete("p")
    assert tier.usage().prefix_bytes == 0 and tier.used_bytes == blk(3).nbytes


def test_a_refused_put_never_leaves_the_old_value_behind():
    device, host = MemoryTier("device", 2 * SIZE), MemoryTier("host", 10 * SIZE)
    store = TieredStore([device, host])
    store.put("k", blk(1, fill=1.0))
    store.put("k", blk(3, fill=3.0))  # too big for the device: lands in host
    block, tier = store.get("k")
    assert tier == "host" and float(block.keys.flatten()[0]) == 3.0


def test_touch_orders_a_chain_leaf_first():
    device = MemoryTier("device", 4 * SIZE)
    store = TieredStore([device])
    for key in ("root", "mid", "leaf"):
        store.put(key, blk(), kind="prefix")
    store.touch(["leaf", "mid", "root", "absent"])  # the root is now the most recently used
    store.put("m1", blk())
    assert evicted_keys(device.put("m2", blk())) == ["leaf"]
    assert store.stats().num_gets == 0  # touching is not a lookup


def test_invalid_kind_is_rejected():
    store = TieredStore([MemoryTier("device", 4 * SIZE)])
    with pytest.raises(ValueError, match="kind"):
        store.put("k", blk(), kind="chunk")


def test_store_acquire_release_protects_device_entries():
    device, host = MemoryTier("device", 2 * SIZE), MemoryTier("host", 10 * SIZE)
    store = TieredStore([device, host])
    store.put("p", blk(), kind="prefix")
    store.acquire(["p", "absent"])  # "absent": nothing to hold, and its release is a no-op
    for key in ("m1", "m2", "m3"):
        store.put(key, blk())
    assert device.contains("p") and store.stats().tiers[0].num_referenced == 1
    store.release(["p", "p", "absent", "absent"])  # more releases than acquires: no error, no negatives
    store.put("m4", blk())
    assert not device.contains("p") and store.tier_of("p").name == "host"  # evicted first once released
    store.acquire(["p"])
    store.release(["p"])
    assert host.usage().num_referenced == 0


def test_kinds_and_ttls_survive_demotion_and_promotion():
    clock = FakeClock()
    device, host = MemoryTier("device", SIZE, clock=clock), MemoryTier("host", 10 * SIZE, clock=clock)
    store = TieredStore([device, host])
    store.put("p", blk(fill=1.0), kind="prefix", ttl_s=5.0)
    store.put("m", blk(fill=2.0))
    assert host.lookup("p").kind == "prefix" and host.lookup("p").ttl_s == 5.0  # demoted with kind and TTL
    clock.now = 1.0
    block, tier = store.get("p")
    assert tier == "host" and float(block.keys.flatten()[0]) == 1.0
    assert device.lookup("p").kind == "prefix" and device.lookup("p").ttl_s == 4.0  # promoted likewise
    assert host.lookup("m").kind == "module"
    stats = {t.name: t for t in store.stats().tiers}
    assert stats["device"].prefix_bytes == SIZE and stats["host"].module_bytes == SIZE
    clock.now = 5.0
    assert store.get("p") is None


def test_many_puts_into_a_small_tier_are_fast():
    tier = MemoryTier("t", 100 * SIZE)
    block = blk()
    started = time.perf_counter()
    for i in range(50_000):
        tier.put(f"k{i}", block, kind="prefix" if i % 3 else "module")
    assert time.perf_counter() - started < 5.0
    assert tier.used_bytes == 100 * SIZE and len(tier.keys()) == 100


def test_eviction_does_not_scan_past_protected_entries():
    """100k entries, half of them pinned at the old end of the LRU, then 50k evicting puts."""
    tier = MemoryTier("t", 100_000 * SIZE)
    block = blk()
    started = time.perf_counter()
    for i in range(50_000):
        tier.put(f"pin{i}", block, pinned=True)
    for i in range(50_000):
        tier.put(f"m{i}", block)
    for i in range(50_000):
        tier.put(f"p{i}", block, kind="prefix")
    assert time.perf_counter() - started < 10.0
    assert len(tier.keys()) == 100_000 and tier.contains("pin0") and tier.contains("p49999")


class ReferenceLRU:
    """A slow, obviously-correct model of the eviction rule: scan all keys by recency, prefix first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.order: dict[str, tuple[str, bool, int]] = {}  # key -> (kind, pinned, nbytes), oldest first
        self.refs: dict[str, int] = {}

    def evictable(self, key: str) -> bool:
        return not self.order[key][1] and not self.refs.get(key)

    def touch(self, key: str) -> None:
        self.order[key] = self.order.pop(key)

    def put(self, key: str, kind: str, pinned: bool, nbytes: int) -> list[str] | None:
        if key in self.order:
            old_kind, old_pinned, _ = self.order.pop(key)
            kind, pinned = ("module" if old_kind == "module" else kind), pinned or old_pinned
        used = sum(n for _, _, n in self.order.values())
        if sum(n for k, (_, _, n) in self.order.items() if not self.evictable(k)) + nbytes > self.max_bytes:
            return None  # refused without evicting anything
        evicted = []
        for wanted in ("prefix", "module"):
            for victim in [k for k, (kd, _, _) in self.order.items() if kd == wanted and self.evictable(k)]:
                if used + nbytes <= self.max_bytes:
                    break
                used -= self.order.pop(victim)[2]
                evicted.append(victim)
        self.order[key] = (kind, pinned, nbytes)
        return evicted


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get", "pin", "unpin", "acquire", "release", "delete"]),
                          st.integers(0, 7), st.sampled_from(["module", "prefix"]), st.integers(1, 3),
                          st.booleans()), max_size=80))
def test_memory_tier_matches_a_reference_model(ops):
    tier, model = MemoryTier("t", 6 * SIZE), ReferenceLRU(6 * SIZE)
    for op, key_id, kind, tokens, flag in ops:
        key = f"k{key_id}"
        if op == "put":
            expected = model.put(key, kind, flag and key_id % 4 == 0, blk(tokens).nbytes)
            try:
                got = evicted_keys(tier.put(key, blk(tokens), kind=kind, pinned=flag and key_id % 4 == 0))
            except CapacityError:
                got = None
            assert got == expected  # a refused put has dropped the key's old entry in both
        elif op == "get":
            assert (tier.get(key) is not None) == (key in model.order)
            if key in model.order:
                model.touch(key)
        elif op in ("pin", "unpin"):
            assert getattr(tier, op)(key) == (key in model.order)
            if key in model.order:
                was = model.evictable(key)
                model.order[key] = (model.order[key][0], op == "pin", model.order[key][2])
                if model.evictable(key) and not was:
                    model.touch(key)
        elif op == "acquire":
            tier.acquire(key)
            model.refs[key] = model.refs.get(key, 0) + 1
        elif op == "release":
            tier.release(key)
            if model.refs.get(key):
                model.refs[key] -= 1
                if key in model.order and model.evictable(key):
                    model.touch(key)
        else:
            assert tier.delete(key) == (model.order.pop(key, None) is not None)
        usage = tier.usage()
        assert sorted(tier.keys()) == sorted(model.order) and usage.used_bytes <= tier.max_bytes
        assert usage.used_bytes == sum(n for _, _, n in model.order.values())
        assert usage.prefix_bytes == sum(n for kd, _, n in model.order.values() if kd == "prefix")
        assert usage.num_referenced == sum(1 for k in model.order if model.refs.get(k))
