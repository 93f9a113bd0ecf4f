"""Bounded-load key placement through RoutingPolicy: keys stay where rendezvous hashing puts them until a
replica carries more than its share of recent requests, then whole keys move (pure, no Ray)."""

from __future__ import annotations

import collections
import itertools
import random

import pytest

from promptcache.cluster import ClusterConfigError, RoutingPolicy
from promptcache.cluster.placement import BalanceBound

REPLICAS = ["a", "b"]
IDLE = dict.fromkeys(REPLICAS, 0)


def _keys_owned_by(replica: str, n: int, replicas: list[str] = REPLICAS) -> list[bytes]:
    """n keys whose rendezvous owner among `replicas` is `replica`: the hash's worst case for balance."""
    keys = (f"key-{i}".encode() for i in range(10_000))
    return [k for k in keys if RoutingPolicy.rank(k, replicas)[0] == replica][:n]


def _route(policy: RoutingPolicy, sequence: list[bytes | None], loads=IDLE) -> list[str]:
    served = []
    for key in sequence:
        replica = policy.choose(key, loads).replica_id
        policy.record(key, replica)
        served.append(replica)
    return served


def _traffic(keys: list[bytes], per_key: int, seed: int = 0) -> list[bytes]:
    sequence = [k for k in keys for _ in range(per_key)]
    random.Random(seed).shuffle(sequence)
    return sequence


def test_keys_the_hash_piles_on_one_replica_are_spread_within_the_bound():
    keys = _keys_owned_by("a", 4)
    sequence = _traffic(keys, 60)
    served = _route(RoutingPolicy(), sequence)
    counts = collections.Counter(served)
    assert max(counts.values()) / (len(served) / 2) <= 1.2 + 4 / 120, counts
    by_key = collections.defaultdict(list)
    for key, replica in zip(sequence, served):
        by_key[key].append(replica)
    moves = {k: sum(x != y for x, y in itertools.pairwise(r)) for k, r in by_key.items()}
    assert sorted(moves.values()) == [0, 0, 1, 1], moves  # two whole keys moved, once each
    assert all(r[-1] == "b" for k, r in by_key.items() if moves[k])  # ... and stayed there


def test_without_a_bound_keys_stay_where_the_hash_puts_them():
    keys = _keys_owned_by("a", 4)
    served = _route(RoutingPolicy(balance=None), _traffic(keys, 60))
    assert set(served) == {"a"}


def test_a_key_hotter_than_the_bound_anywhere_stays_with_its_owner():
    (hot,) = _keys_owned_by("b", 1)
    cold = _keys_owned_by("a", 3)
    sequence = _traffic([hot], 200) + _traffic(cold, 5)
    served = _route(RoutingPolicy(), sequence)
    assert {r for k, r in zip(sequence, served) if k == hot} == {"b"}


def test_keyless_requests_count_towards_a_replicas_share():
    policy = RoutingPolicy()
    for _ in range(50):
        policy.record(None, "a")
    (key,) = _keys_owned_by("a", 1)
    assert policy.choose(key, IDLE).replica_id == "b"  # a new key goes where there is room


def test_old_traffic_fades_after_the_half_life():
    policy = RoutingPolicy(balance=BalanceBound(half_life=16))
    for _ in range(50):
        policy.record(None, "a")
    for _ in range(400):  # 25 half-lives of even traffic
        policy.record(None, "a")
        policy.record(None, "b")
    (key,) = _keys_owned_by("a", 1)
    assert policy.choose(key, IDLE).replica_id == "a"


def test_keys_of_a_removed_replica_move_and_the_others_stay():
    replicas = ["a", "b", "c"]
    policy = RoutingPolicy()
    keys = [f"key-{i}".encode() for i in range(30)]
    loads = dict.fromkeys(replicas, 0)
    before = dict(zip(keys, _route(policy, keys, loads)))
    survivors = dict.fromkeys(["a", "b"], 0)
    after = dict(zip(keys, _route(policy, keys, survivors)))
    stayed = [k for k in keys if before[k] != "c" and before[k] == RoutingPolicy.rank(k, replicas)[0]]
    assert len(stayed) >= 15 and all(after[k] == before[k] for k in stayed)  # at their hash's choice: stay
    assert {after[k] for k in keys if before[k] == "c"} == {"a", "b"}


def test_the_load_guard_still_spills_a_saturated_owner():
    (key,) = _keys_owned_by("a", 1)
    choice = RoutingPolicy().choose(key, {"a": 12, "b": 0})
    assert (choice.replica_id, choice.reason, choice.owner_id) == ("b", "load_guard", "a")


@pytest.mark.parametrize("field, value", [("factor", 0.9), ("slack", 0), ("half_life", 0)])
def test_invalid_bounds_are_refused(field, value):
    with pytest.raises(ClusterConfigError, match=field.replace("_", " ").split()[0]):
        BalanceBound(**{field: value})
