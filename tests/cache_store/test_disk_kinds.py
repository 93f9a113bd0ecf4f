"""The disk tier with kinds: prefix-first LRU by access time, TTLs, kinds kept across processes' files."""

from __future__ import annotations

import logging
import shutil
import time

import torch

from promptcache.cache_store import DiskTier, KVBlock, StoreConfig, build_store, dumps


def blk(tokens: int = 4, fill: float = 1.0) -> KVBlock:
    keys = torch.full((2, 2, tokens, 8), fill)
    return KVBlock(keys, keys * 2, torch.arange(tokens))


SIZE = len(dumps(blk(), "x"))


def test_prefix_files_are_evicted_before_modules_each_in_lru_order(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=4 * SIZE)
    tier.put("m1", blk())
    tier.put("p1", blk(), kind="prefix")
    tier.put("m2", blk())
    tier.put("p2", blk(), kind="prefix")
    tier.get("p1")
    tier.get("m1")
    tier.put("m3", blk())
    assert sorted(tier.keys()) == ["m1", "m2", "m3", "p1"]
    tier.put("m4", blk())
    tier.put("m5", blk())
    assert sorted(tier.keys()) == ["m1", "m3", "m4", "m5"]
    tier.put("p3", blk(), kind="prefix")  # the file being written is never its own victim
    assert sorted(tier.keys()) == ["m3", "m4", "m5", "p3"] and tier.used_bytes <= tier.max_bytes
    assert tier.lookup("p3").kind == "prefix" and tier.lookup("m3").kind == "module"
    assert tier.usage() == (4 * SIZE, 4, SIZE, 0)


def test_a_re_put_never_downgrades_and_an_upgrade_replaces_the_prefix_file(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10 * SIZE)
    tier.put("m", blk())
    tier.put("m", blk(), kind="prefix")
    assert tier.lookup("m").kind == "module"
    tier.put("p", blk(), kind="prefix")
    tier.put("p", blk(fill=3.0))
    hit = tier.lookup("p")
    assert hit.kind == "module" and float(hit.block.keys.flatten()[0]) == 3.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.kv", "p.kv"]
    assert tier.delete("p") and not tier.contains("p") and not tier.delete("p")


def test_ttl_on_disk(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10 * SIZE)
    tier.put("brief", blk(), kind="prefix", ttl_s=0.2)
    tier.put("forever", blk())
    hit = tier.lookup("brief")
    assert hit.kind == "prefix" and 0 < hit.ttl_s <= 0.2 and tier.contains("brief")
    assert tier.lookup("forever").ttl_s is None
    time.sleep(0.3)
    assert not tier.contains("brief") and tier.lookup("brief") is None
    assert tier.keys() == ["forever"]  # the expired file was removed when read


def test_files_written_before_kinds_still_read_as_modules(tmp_path):
    (tmp_path / "old.kv").write_bytes(dumps(blk(fill=5.0), "old"))
    hit = DiskTier(tmp_path, max_bytes=10 * SIZE).lookup("old")
    assert hit.kind == "module" and hit.ttl_s is None and float(hit.block.keys.flatten()[0]) == 5.0


def test_a_broken_disk_is_a_miss_and_a_warning_never_an_error(tmp_path, caplog):
    store = build_store(StoreConfig(device_max_bytes=SIZE, host_max_bytes=SIZE, disk_dir=str(tmp_path / "kv")))
    for key in "abc":
        store.put(key, blk())  # "a" is pushed down to disk, "b" to host
    assert store.flush(timeout_s=5) and store.tier_of("a").name == "disk"
    shutil.rmtree(tmp_path / "kv")
    (tmp_path / "kv").write_bytes(b"not a directory")  # every read and write now raises OSError
    with caplog.at_level(logging.WARNING):
        assert store.get("a") is None
        store.put("c", blk())
        store.put("d", blk())
        store.put("e", blk())  # demotions to the broken disk
        assert store.flush(timeout_s=5)
    assert store.get("e") is not None
    assert "disk" in caplog.text.lower()
