"""RoutingPolicy: rendezvous ownership and the SGLang-like load guard (pure, no Ray)."""

from __future__ import annotations

import collections
import random

import pytest

from promptcache.cluster import ClusterConfigError, LoadGuard, NoReplicaError, RoutingPolicy

REPLICAS = [f"r{i}" for i in range(8)]


def _keys(n: int) -> list[bytes]:
    return [f"key-{i}".encode() for i in range(n)]


def test_owner_is_stable_and_independent_of_candidate_order():
    policy = RoutingPolicy()
    idle = dict.fromkeys(REPLICAS, 0)
    shuffled = dict.fromkeys(random.Random(1).sample(REPLICAS, len(REPLICAS)), 0)
    for key in _keys(50):
        assert policy.choose(key, idle).replica_id == policy.choose(key, shuffled).replica_id
        assert policy.choose(key, idle).reason == "affinity"


def test_keys_spread_evenly_over_replicas():
    policy = RoutingPolicy()
    counts = collections.Counter(policy.choose(k, dict.fromkeys(REPLICAS, 0)).replica_id for k in _keys(8000))
    assert set(counts) == set(REPLICAS)
    assert max(counts.values()) / (8000 / len(REPLICAS)) < 1.1  # within 10% of the mean


def test_removing_a_replica_moves_only_its_keys():
    # Rendezvous hashing: a key changes owner only if its owner left, and then it goes to its second choice.
    policy = RoutingPolicy()
    before = {k: policy.rank(k, REPLICAS) for k in _keys(2000)}
    survivors = [r for r in REPLICAS if r != "r3"]
    for key, ranking in before.items():
        owner = policy.choose(key, dict.fromkeys(survivors, 0)).replica_id
        assert owner == (ranking[1] if ranking[0] == "r3" else ranking[0])


def test_adding_a_replica_takes_about_one_share_of_keys():
    policy = RoutingPolicy()
    keys = _keys(4000)
    before = {k: policy.choose(k, dict.fromkeys(REPLICAS, 0)).replica_id for k in keys}
    after = {k: policy.choose(k, dict.fromkeys([*REPLICAS, "r8"], 0)).replica_id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "r8" for k in moved)
    assert 0.07 < len(moved) / len(keys) < 0.16  # ~1/9


@pytest.mark.parametrize(("owner_load", "min_load", "overloaded"), [
    (4, 0, False),  # 4 more: not more than abs 4
    (5, 0, True),
    (9, 4, True),  # 5 more and 2.25x
    (10, 7, False),  # only 3 more
    (20, 14, False),  # 6 more but only 1.43x
    (22, 14, True),  # 8 more and 1.57x
])
def test_load_guard_needs_both_thresholds(owner_load, min_load, overloaded):
    assert LoadGuard(abs_threshold=4, rel_threshold=1.5).is_overloaded(owner_load, min_load) is overloaded


def test_busy_owner_spills_to_the_least_loaded_and_consistently():
    policy = RoutingPolicy(LoadGuard(abs_threshold=2, rel_threshold=1.5))
    key = b"hot schema"
    owner, second, *_ = policy.rank(key, REPLICAS)
    loads = dict.fromkeys(REPLICAS, 1) | {owner: 6}
    choice = policy.choose(key, loads)
    # Every other replica is equally idle: the spill goes to the key's second choice, every time.
    assert (choice.replica_id, choice.reason, choice.owner_id) == (second, "load_guard", owner)
    loads[second] = 3
    assert policy.choose(key, loads).replica_id not in (owner, second)
    assert policy.choose(key, dict.fromkeys(REPLICAS, 1) | {owner: 3}).replica_id == owner  # within the guard


def test_order_lists_every_candidate_once():
    policy = RoutingPolicy()
    loads = {r: i for i, r in enumerate(REPLICAS)}
    for key in [*_keys(10), None]:
        order = policy.order(key, loads)
        assert sorted(c.replica_id for c in order) == sorted(REPLICAS)


def test_requests_without_a_key_go_to_the_least_loaded():
    policy = RoutingPolicy(rng=random.Random(0))
    loads = dict.fromkeys(REPLICAS, 3) | {"r5": 1, "r6": 1}
    chosen = {policy.choose(None, loads).replica_id for _ in range(50)}
    assert chosen == {"r5", "r6"}  # ties are broken at random


def test_invalid_guard_and_empty_candidates_are_refused():
    with pytest.raises(ClusterConfigError, match="rel_threshold"):
        LoadGuard(rel_threshold=0.5)
    with pytest.raises(ClusterConfigError, match="abs_threshold"):
        LoadGuard(abs_threshold=-1)
    with pytest.raises(NoReplicaError, match="no replica"):
        RoutingPolicy().choose(b"k", {})
