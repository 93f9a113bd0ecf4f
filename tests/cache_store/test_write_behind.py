"""Write-behind to shared tiers: put returns first, flush, overflow drops, deletes win, kinds survive.

Behaviour against Redis uses a real redis-server; a gated in-process stand-in for a slow shared tier
is used only where the test must hold a write in flight (timing and ordering).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from promptcache.cache_store import (
    CapacityError,
    KVBlock,
    MemoryTier,
    RedisTier,
    StoreConfig,
    TieredStore,
    build_store,
)


def blk(tokens: int = 1, fill: float = 1.0) -> KVBlock:
    keys = torch.full((2, 2, tokens, 8), fill)
    return KVBlock(keys, keys * 2, torch.arange(tokens))


SIZE = blk().nbytes


class GatedShared(MemoryTier):
    """A slow shared tier: `put` and `lookup` wait for their gate (open by default)."""

    is_shared = True

    def __init__(self, max_bytes: int = 1 << 20) -> None:
        super().__init__("slow", max_bytes)
        self.write_gate, self.read_gate = threading.Event(), threading.Event()
        self.write_gate.set()
        self.read_gate.set()
        self.writing = threading.Event()
        self.put_threads: list[threading.Thread] = []

    def put(self, key, block, **kwargs):
        self.put_threads.append(threading.current_thread())
        self.writing.set()
        assert self.write_gate.wait(10)
        if key == "bad":
            raise RuntimeError("disk on fire")
        return super().put(key, block, **kwargs)

    def lookup(self, key):
        assert self.read_gate.wait(10)
        return super().lookup(key)


def gated_store(**kwargs) -> tuple[TieredStore, GatedShared]:
    shared = GatedShared()
    return TieredStore([MemoryTier("device", 1 << 20), shared], **kwargs), shared


def test_put_returns_before_the_shared_write_and_flush_waits_for_it():
    store, shared = gated_store()
    shared.write_gate.clear()
    started = time.perf_counter()
    store.put("k", blk())
    assert time.perf_counter() - started < 0.5
    assert store.tier_of("k").name == "device" and not shared.contains("k")
    assert store.stats().pending_write_bytes == SIZE and not store.flush(timeout_s=0.05)
    shared.write_gate.set()
    assert store.flush(timeout_s=5) and shared.contains("k")
    assert store.stats().pending_write_bytes == 0 and store.stats().num_pending_writes == 0
    assert threading.current_thread() not in shared.put_threads


def test_store_lock_is_not_held_during_shared_io():
    store, shared = gated_store()
    shared.write_gate.clear()
    shared.read_gate.clear()
    store.put("writing", blk())
    assert shared.writing.wait(5)  # the writer is now stuck inside the shared tier's put
    reader = threading.Thread(target=store.get, args=("missing",))
    reader.start()  # stuck inside the shared tier's lookup
    started = time.perf_counter()
    store.put("other", blk())
    assert store.get("other")[1] == "device" and store.tier_of("writing").name == "device"
    store.acquire(["other"])
    store.release(["other"])
    assert time.perf_counter() - started < 1.0
    shared.write_gate.set()
    shared.read_gate.set()
    reader.join(5)
    assert store.flush(timeout_s=5)


def test_a_full_queue_drops_writes_and_counts_them():
    store, shared = gated_store(write_behind_max_bytes=3 * SIZE)
    shared.write_gate.clear()
    for i in range(5):
        store.put(f"k{i}", blk())
    stats = store.stats()
    assert stats.dropped_writes == 2 and stats.pending_write_bytes == 3 * SIZE
    shared.write_gate.set()
    assert store.flush(timeout_s=5)
    assert sorted(shared.keys()) == ["k0", "k1", "k2"]
    assert all(store.tier_of(f"k{i}").name == "device" for i in range(5))  # the device tier has them all


def test_a_failing_write_does_not_stop_the_writer(caplog):
    store, shared = gated_store()
    store.put("bad", blk())
    store.put("good", blk())
    assert store.flush(timeout_s=5) and shared.contains("good") and "failed to write a block" in caplog.text


def test_delete_cancels_a_queued_write_and_follows_a_running_one():
    store, shared = gated_store()
    shared.write_gate.clear()
    store.put("running", blk())
    assert shared.writing.wait(5)
    store.put("queued", blk())
    assert store.delete("queued") and store.delete("running")
    assert store.stats().pending_write_bytes == SIZE  # the cancelled write no longer holds queue space
    shared.write_gate.set()
    assert store.flush(timeout_s=5)
    assert not shared.contains("queued") and not shared.contains("running") and store.tier_of("running") is None


def test_unpin_is_ordered_after_a_queued_pinned_write():
    store, shared = gated_store()
    shared.max_bytes = SIZE
    shared.write_gate.clear()
    store.put("k", blk(), pinned=True)
    assert store.unpin("k")
    shared.write_gate.set()
    assert store.flush(timeout_s=5)
    shared.put("other", blk())  # would raise CapacityError if "k" had stayed pinned
    assert not shared.contains("k")
    shared.pin("other")
    with pytest.raises(CapacityError):
        shared.put("third", blk())


def test_close_flushes_and_the_store_stays_usable():
    store, shared = gated_store()
    store.put("a", blk())
    assert store.close(timeout_s=5) and shared.contains("a")
    store.put("b", blk())
    assert store.flush(timeout_s=5) and shared.contains("b")
    assert store.close()


def test_flush_makes_writes_visible_to_another_replica(redis_server):
    config = StoreConfig(redis_url=redis_server.url, redis_namespace="wb")
    one, two = build_store(config), build_store(config)
    one.put("p", blk(fill=3.0), kind="prefix", ttl_s=60)
    one.put("m", blk(fill=4.0))
    assert one.flush(timeout_s=5)
    block, tier = two.get("p")
    assert tier == "redis" and float(block.keys.flatten()[0]) == 3.0
    hit = two.tiers[0].lookup("p")
    assert hit.kind == "prefix" and 0 < hit.ttl_s <= 60  # promoted with its kind and TTL
    assert two.tiers[-1].lookup("m").kind == "module"
    redis_stats = one.stats().tiers[-1]
    assert redis_stats.prefix_bytes > 0 and redis_stats.module_bytes > 0 and redis_stats.num_entries == 2


def test_put_into_redis_returns_before_the_write(redis_server):
    big = KVBlock(torch.randn(4, 8, 4096, 64), torch.randn(4, 8, 4096, 64), torch.arange(4096))  # 64 MiB
    store = build_store(StoreConfig(device_max_bytes=1 << 30, redis_url=redis_server.url, redis_max_bytes=1 << 30,
                                    redis_timeout_s=10))
    started = time.perf_counter()
    store.put("big", big)
    put_s = time.perf_counter() - started
    assert store.stats().pending_write_bytes == big.nbytes  # not written yet: serializing 64 MiB takes longer
    assert store.flush(timeout_s=60) and store.tiers[-1].contains("big")
    assert put_s < max(0.5, time.perf_counter() - started - put_s)


def test_serialization_runs_on_the_writer_thread(redis_server):
    threads = []

    class SpyRedis(RedisTier):
        def put(self, key, block, **kwargs):
            threads.append(threading.current_thread())
            return super().put(key, block, **kwargs)

    store = TieredStore([MemoryTier("device", 1 << 20), SpyRedis(redis_server.url, max_bytes=1 << 20)])
    store.put("k", blk())
    assert store.flush(timeout_s=5) and threads and threading.current_thread() not in threads


def test_overflow_against_redis_drops_the_write(redis_server):
    store = build_store(StoreConfig(redis_url=redis_server.url, write_behind_max_bytes=SIZE // 2))
    store.put("k", blk())
    assert store.flush(timeout_s=5)
    assert store.stats().dropped_writes == 1 and not store.tiers[-1].contains("k")
    assert store.tier_of("k").name == "device"


def test_deletes_right_after_puts_never_resurrect_in_redis(redis_server):
    store = build_store(StoreConfig(redis_url=redis_server.url, redis_namespace="del"))
    keys = [f"k{i}" for i in range(20)]
    for key in keys:
        store.put(key, blk(64))
    for key in keys:
        store.delete(key)
    assert store.flush(timeout_s=5)
    time.sleep(0.05)
    fresh = RedisTier(redis_server.url, max_bytes=1 << 30, namespace="del")
    assert not any(fresh.contains(key) for key in keys) and fresh.used_bytes == 0


def test_kinds_survive_demotion_into_redis_and_promotion_back(redis_server):
    tiers = [MemoryTier("device", blk().nbytes), MemoryTier("host", blk().nbytes),
             RedisTier(redis_server.url, max_bytes=1 << 20, namespace="demote")]
    store = TieredStore(tiers, write_through_shared=False)
    store.put("p", blk(fill=1.0), kind="prefix", ttl_s=60)
    store.put("m1", blk(fill=2.0))
    store.put("m2", blk(fill=3.0))  # p: device -> host -> (writer) -> redis
    assert store.flush(timeout_s=5)
    hit = tiers[2].lookup("p")
    assert hit.kind == "prefix" and 0 < hit.ttl_s <= 60
    assert store.get("p")[1] == "redis" and tiers[0].lookup("p").kind == "prefix"
    assert store.flush(timeout_s=5)  # the promotion pushed m2 to host and m1 to redis
    assert tiers[1].lookup("m2").kind == "module" and tiers[2].lookup("m1").kind == "module"


def test_queued_writes_are_flushed_at_interpreter_exit(redis_server):
    script = (
        "import torch\n"
        "from promptcache.cache_store import KVBlock, StoreConfig, build_store\n"
        f"store = build_store(StoreConfig(redis_url={redis_server.url!r}, redis_namespace='exit'))\n"
        "keys = torch.ones(2, 2, 1024, 64)\n"
        "for i in range(8):\n"
        "    store.put(f'k{i}', KVBlock(keys, keys, torch.arange(1024)))\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    tier = RedisTier(redis_server.url, max_bytes=1 << 30, namespace="exit")
    assert all(tier.contains(f"k{i}") for i in range(8))


def test_concurrent_operations_with_a_shared_tier_do_not_deadlock(redis_server):
    tiers = [MemoryTier("device", 4 * SIZE), MemoryTier("host", 8 * SIZE),
             RedisTier(redis_server.url, max_bytes=16 * SIZE * 4, namespace="mt")]
    store = TieredStore(tiers)

    def worker(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for i in range(150):
            key = f"k{int(torch.randint(0, 24, (1,), generator=g))}"
            action = i % 6
            if action == 0:
                store.put(key, blk(), kind="prefix" if seed % 2 else "module")
            elif action == 1:
                store.delete(key)
            elif action == 2:
                store.acquire([key])
                store.get(key)
                store.release([key])
            elif action == 3:
                store.pin(key) if seed == 0 else store.unpin(key)
            else:
                store.get(key)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert store.flush(timeout_s=10)
    for tier in tiers:
        assert tier.used_bytes <= tier.max_bytes
    assert all(tier.usage().num_referenced == 0 for tier in tiers[:2])
