"""Per-owner byte shares (tenants): an owner at its share evicts only its own entries — in-process tiers
and the Redis tier (real redis-server), against the same scenario without shares as the control."""

from __future__ import annotations

import pytest
import torch

from promptcache.cache_store import (
    CapacityError,
    KVBlock,
    MemoryTier,
    OwnerShares,
    RedisTier,
    StoreConfig,
    build_store,
    owned_salt,
)


def blk(fill: float = 1.0) -> KVBlock:
    keys = torch.full((1, 1, 4, 8), fill)  # 128 bytes of keys, 128 of values, 32 of positions
    return KVBlock(keys, keys.clone(), torch.arange(4))


BLOCK = blk().nbytes


def _flood(put, contains) -> tuple[list[bool], list[bool]]:
    """b fills half the tier first (the oldest entries), a fills the rest, then a writes four more."""
    for i in range(4):
        put(f"b{i}", "beta")
    for i in range(8):
        put(f"a{i}", "alpha")
    return [contains(f"b{i}") for i in range(4)], [contains(f"a{i}") for i in range(8)]


@pytest.mark.parametrize("shared", [True, False])
def test_memory_tier_owner_at_its_share_evicts_only_its_own(shared):
    shares = OwnerShares({"alpha": 0.5, "beta": 0.5}) if shared else None
    tier = MemoryTier("host", 8 * BLOCK, shares=shares)
    beta, alpha = _flood(lambda k, o: tier.put(k, blk(), kind="prefix", owner=o), tier.contains)
    if shared:
        assert beta == [True] * 4  # beta, within its share, lost nothing
        assert alpha == [False] * 4 + [True] * 4  # alpha made room from its own oldest entries
    else:  # the control: plain LRU takes beta's (older) entries
        assert beta == [False] * 4 and alpha == [True] * 8


def test_memory_tier_refuses_rather_than_evicting_others_when_own_entries_are_in_use():
    tier = MemoryTier("host", 8 * BLOCK, shares=OwnerShares({"alpha": 0.5}))
    for i in range(4):
        tier.put(f"a{i}", blk(), owner="alpha")
        tier.acquire(f"a{i}")
    tier.put("b0", blk(), owner="beta")
    with pytest.raises(CapacityError, match="share"):
        tier.put("a4", blk(), owner="alpha")
    assert tier.contains("b0")
    tier.release("a0")
    tier.put("a4", blk(), owner="alpha")  # now a0 (alpha's, released) makes room
    assert not tier.contains("a0") and tier.contains("a4") and tier.contains("b0")


@pytest.mark.parametrize("shared", [True, False])
def test_redis_tier_owner_at_its_share_evicts_only_its_own(redis_server, shared):
    shares = OwnerShares({"alpha": 0.5, "beta": 0.5}) if shared else None
    tier = RedisTier(redis_server.url, max_bytes=1, namespace=f"own{shared}", shares=shares)
    from promptcache.cache_store import dumps

    tier.max_bytes = 8 * len(dumps(blk(), "b0"))  # eight blobs fill it
    beta, alpha = _flood(lambda k, o: tier.put(k, blk(), kind="prefix", owner=o), tier.contains)
    if shared:
        assert beta == [True] * 4 and alpha == [False] * 4 + [True] * 4
        assert tier.lookup("b1").owner == "beta"
    else:
        assert beta == [False] * 4 and alpha == [True] * 8
    tier.delete("a7")  # a delete keeps the per-owner (and total) count right: room for one more, no eviction
    tier.put("a8", blk(), owner="alpha")
    assert tier.contains("a4") and tier.contains("a8")
    if shared:
        tier.put("a9", blk(), owner="alpha")  # over alpha's share again: its own oldest goes
        assert not tier.contains("a4") and all(tier.contains(f"b{i}") for i in range(4))


def test_owner_travels_with_demotion_and_promotion():
    store = build_store(StoreConfig(device_max_bytes=2 * BLOCK, host_max_bytes=8 * BLOCK,
                                    owner_shares=(("alpha", 0.5),)))
    device, host = store.tiers[0], store.tiers[1]
    for i in range(3):
        store.put(f"a{i}", blk(), owner="alpha")
    assert host.lookup("a0").owner == "alpha"  # demoted with its owner
    assert store.get("a0")[1] == "host" and device.lookup("a0").owner == "alpha"  # promoted with it


def test_owned_salts_keep_owners_and_client_salts_apart():
    assert owned_salt("alpha", None) != owned_salt("alpha", "") != owned_salt("beta", None)
    assert owned_salt("alpha", "x\u0000beta") != owned_salt("alpha", None) and owned_salt("alpha", None) != "alpha"
