"""The cache heals (docs/security.md, "Rotating the blob key"): a value that fails verification — sealed under
another key, forged, damaged — is never counted as present nor marked as used, is dropped, and never blocks
the rightful write that replaces it; the schema registry likewise. Against a real Redis."""

from __future__ import annotations

import pytest
import redis
import torch

import promptcache.cache_store.disk_tier as disk_module
from promptcache.cache_store import (
    BlobSigner,
    DiskTier,
    KVBlock,
    RedisTier,
    SchemaExistsError,
    SchemaRegistry,
    StoreConfig,
    StoredSchema,
    build_store,
)

OLD, NEW = b"o" * 32, b"n" * 32
NS = "rot"


def blk(tokens: int, fill: float) -> KVBlock:
    keys = torch.full((2, 2, tokens, 8), fill)
    return KVBlock(keys, keys * 2, torch.arange(tokens))


def tier(url: str, key: bytes | None, signer: BlobSigner | None = None) -> RedisTier:
    return RedisTier(url, max_bytes=1 << 20, namespace=NS, signer=signer or BlobSigner(key))


def store(url: str, key: bytes):
    """A fresh process's store: empty in-process tiers over the shared Redis."""
    return build_store(StoreConfig(device_max_bytes=1 << 20, host_max_bytes=1 << 20, redis_url=url,
                                   redis_namespace=NS, blob_key=key))


def raw(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2)


class RacingSigner(BlobSigner):
    """Checks with `key`; while checking its first value, runs `meanwhile` (another replica's write)."""

    def __init__(self, key: bytes, meanwhile) -> None:
        super().__init__(key)
        self.meanwhile = meanwhile

    def open(self, storage_key: str, sealed: bytes) -> bytes | None:
        self._run_meanwhile()
        return super().open(storage_key, sealed)

    def open_block(self, storage_key: str, sealed: bytes) -> tuple[bytes, bool] | None:
        self._run_meanwhile()
        return super().open_block(storage_key, sealed)

    def _run_meanwhile(self) -> None:
        if self.meanwhile is not None:
            self.meanwhile, run = None, self.meanwhile
            run()


def test_after_rotation_every_hot_key_is_served_again_after_one_rewrite(redis_server):
    blocks = {f"key{i}": blk(4, float(i)) for i in range(8)}
    old = store(redis_server.url, OLD)
    for key, block in blocks.items():
        old.put(key, block)
    assert old.flush(30)
    reader = store(redis_server.url, OLD)
    assert all(reader.get(key)[1] == "redis" for key in blocks)  # hot under the old key

    new = store(redis_server.url, NEW)
    assert all(new.tier_of(key) is None for key in blocks)  # sealed under the old key: not present
    client = raw(redis_server.url)
    assert not any(client.exists(f"promptcache:{NS}:kv:{key}") for key in blocks)  # and dropped

    for key, block in blocks.items():  # the one rewrite (write-through to Redis)
        new.put(key, block)
    assert new.flush(30)
    replica = store(redis_server.url, NEW)
    for key, block in blocks.items():
        hit = replica.get(key)
        assert hit is not None and hit[1] == "redis" and torch.equal(hit[0].keys, block.keys)


def test_write_through_replaces_a_failing_value_it_never_read(redis_server):
    old = store(redis_server.url, OLD)
    old.put("k", blk(3, 1.0))
    assert old.flush(30)
    new = store(redis_server.url, NEW)
    new.put("k", blk(3, 2.0))  # no read first: the stale value is still in Redis when the write runs
    assert new.flush(30)
    hit = store(redis_server.url, NEW).get("k")
    assert hit is not None and hit[1] == "redis" and float(hit[0].keys.flatten()[0]) == 2.0


def test_a_failing_value_is_never_marked_as_used(redis_server):
    old = tier(redis_server.url, OLD)
    for key in ("read", "checked", "kept"):
        old.put(key, blk(3, 1.0), ttl_s=60, kind="prefix")
    client = raw(redis_server.url)
    seq, lru = f"promptcache:{NS}:seq", f"promptcache:{NS}:lru"
    before = int(client.get(seq))
    total = int(client.get(f"promptcache:{NS}:bytes"))

    new = tier(redis_server.url, NEW)
    assert new.get("read") is None and not new.contains("checked")
    assert int(client.get(seq)) == before  # no use recorded for either
    assert client.zscore(lru, "read") is None and client.zscore(lru, "checked") is None  # dropped, not refreshed
    assert int(client.get(f"promptcache:{NS}:bytes")) == total // 3  # only "kept" is left in the budget
    assert old.get("kept") is not None and int(client.get(seq)) == before + 1  # a verified read is marked as used
    assert 0 < client.pttl(f"promptcache:{NS}:kv:kept") <= 60_000  # reads never extend a TTL


def test_contains_counts_only_values_that_verify(redis_server):
    client = raw(redis_server.url)
    unsigned = tier(redis_server.url, None)
    unsigned.put("damaged", blk(3, 1.0))
    blob = client.get(f"promptcache:{NS}:kv:damaged")
    client.set(f"promptcache:{NS}:kv:damaged", blob[:-1] + bytes([blob[-1] ^ 1]))  # checksum no longer matches
    client.set(f"promptcache:{NS}:kv:garbage", b"not a block")
    fresh = tier(redis_server.url, None)
    assert not fresh.contains("damaged") and not fresh.contains("garbage")
    assert not client.exists(f"promptcache:{NS}:kv:damaged") and not client.exists(f"promptcache:{NS}:kv:garbage")

    signed = tier(redis_server.url, NEW)
    signed.put("x", blk(3, 1.0))
    signed.put("y", blk(3, 2.0))
    assert signed.contains("x")  # written here: vouched for by its head
    client.set(f"promptcache:{NS}:kv:x", client.get(f"promptcache:{NS}:kv:y"))  # a valid value, another key's
    assert not signed.contains("x") and signed.contains("y")


def test_a_failing_read_keeps_the_rightful_write_that_lands_meanwhile(redis_server):
    tier(redis_server.url, OLD).put("k", blk(3, 1.0))
    writer = tier(redis_server.url, NEW)
    racing = tier(redis_server.url, NEW, RacingSigner(NEW, lambda: writer.put("k", blk(3, 9.0))))
    assert racing.get("k") is None  # what it read was sealed under the old key ...
    hit = tier(redis_server.url, NEW).get("k")
    assert hit is not None and float(hit.keys.flatten()[0]) == 9.0  # ... but the new value is not deleted


def test_disk_drops_damaged_files_but_not_a_replacement(tmp_path):
    disk = DiskTier(tmp_path, max_bytes=1 << 20)
    disk.put("k", blk(3, 1.0))
    path = tmp_path / "k.kv"
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    fresh = DiskTier(tmp_path, max_bytes=1 << 20)
    assert not fresh.contains("k") and not path.exists()
    disk.put("k", blk(3, 2.0))
    assert fresh.contains("k") and float(fresh.get("k").keys.flatten()[0]) == 2.0

    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    real_loads = disk_module.loads

    def loads_after_a_rewrite(data, *, expect_key=None):  # another process replaces the file mid-read
        disk_module.loads = real_loads
        disk.put("k", blk(3, 3.0))
        return real_loads(data, expect_key=expect_key)

    disk_module.loads = loads_after_a_rewrite
    try:
        assert DiskTier(tmp_path, max_bytes=1 << 20).get("k") is None
    finally:
        disk_module.loads = real_loads
    assert float(fresh.get("k").keys.flatten()[0]) == 3.0


PML = "<schema name='docs'><module name='m'>{}</module></schema>"


def test_registry_entry_sealed_under_an_old_key_does_not_hold_its_name(redis_server):
    old = SchemaRegistry(redis_server.url, namespace=NS, signer=BlobSigner(OLD))
    old.save("docs", PML.format("old"), {"num_tokens": 3})
    old.save("lost", PML.format("lost"))

    new = SchemaRegistry(redis_server.url, namespace=NS, signer=BlobSigner(NEW))
    assert new.load("docs") is None and new.list() == []
    saved = new.save("docs", PML.format("new"), {"num_tokens": 3})  # no SchemaExistsError
    fresh = SchemaRegistry(redis_server.url, namespace=NS, signer=BlobSigner(NEW))
    assert fresh.load("docs").pml_text == PML.format("new") and fresh.state().versions["docs"] == saved.version
    with pytest.raises(SchemaExistsError):  # the rightful entry does hold it
        fresh.save("docs", PML.format("again"))
    assert new.restore(StoredSchema("lost", PML.format("mine"), version="v7"))
    assert fresh.load("lost").version == "v7" and [s.name for s in fresh.list()] == ["docs", "lost"]


def test_undecodable_registry_entry_reads_as_absent_and_is_replaced(redis_server):
    raw(redis_server.url).set(f"promptcache:{NS}:schema:docs", b"\xff not json")
    registry = SchemaRegistry(redis_server.url, namespace=NS)
    assert registry.load("docs") is None and registry.list() == []
    registry.save("docs", PML.format("x"))
    assert SchemaRegistry(redis_server.url, namespace=NS).load("docs").pml_text == PML.format("x")


def test_registry_replacement_yields_to_a_rightful_write_that_lands_first(redis_server):
    SchemaRegistry(redis_server.url, namespace=NS, signer=BlobSigner(OLD)).save("docs", PML.format("old"))
    other = SchemaRegistry(redis_server.url, namespace=NS, signer=BlobSigner(NEW))
    racing = SchemaRegistry(redis_server.url, namespace=NS,
                            signer=RacingSigner(NEW, lambda: other.save("docs", PML.format("other"))))
    with pytest.raises(SchemaExistsError):
        racing.save("docs", PML.format("mine"))
    assert other.load("docs").pml_text == PML.format("other")
