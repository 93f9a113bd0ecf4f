"""RoutingPolicy: which replica serves a request, from its affinity key and the replicas' loads. Pure (no Ray):
the Ray request router, the routing simulator and the unit tests all call it (docs/scaling.md explains it)."""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from promptcache.cluster.errors import ClusterConfigError, NoReplicaError
from promptcache.cluster.placement import BalanceBound, KeyPlacement

DEFAULT_BALANCE = BalanceBound()


@dataclass(frozen=True, slots=True)
class LoadGuard:
    """When the key's owner is too busy. Loads are requests in flight on a replica."""

    abs_threshold: int = 4
    rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.abs_threshold < 0:
            raise ClusterConfigError(f"abs_threshold must be >= 0 requests, got {self.abs_threshold}")
        if self.rel_threshold < 1:
            raise ClusterConfigError(f"rel_threshold must be >= 1, got {self.rel_threshold}")

    def is_overloaded(self, owner_load: int, min_load: int) -> bool:
        return owner_load - min_load > self.abs_threshold and owner_load > self.rel_threshold * min_load


@dataclass(frozen=True, slots=True)
class Choice:
    replica_id: str
    reason: Literal["affinity", "load_guard", "least_loaded"]
    owner_id: str | None  # the key's rendezvous owner (None: no key)


class RoutingPolicy:
    """A request with a key goes to the key's owner: the first replica in the key's rendezvous (highest-random-
    weight) order that KeyPlacement finds room on (`balance=None`: always the first). The load guard skips an
    owner much busier than the least-loaded replica (SGLang's two-threshold test), for the least loaded, ties
    going to the replica ranking higher for the key: a hot key spills onto a consistent second replica.
    A request without a key goes to the least-loaded replica (ties: random)."""

    def __init__(self, guard: LoadGuard = LoadGuard(), balance: BalanceBound | None = DEFAULT_BALANCE,
                 rng: random.Random | None = None) -> None:
        self.guard = guard
        self._placement = None if balance is None else KeyPlacement(balance)
        self._rng = rng or random.Random()

    @staticmethod
    def rank(key: bytes, replica_ids: Sequence[str]) -> list[str]:
        """Replicas in rendezvous order for `key`: the hash's choice first."""
        return list(_rank(key, tuple(replica_ids)))

    def choose(self, key: bytes | None, loads: Mapping[str, int]) -> Choice:
        """The replica for `key` given each candidate's load (requests in flight); NoReplicaError if none."""
        return self.order(key, loads)[0]

    def order(self, key: bytes | None, loads: Mapping[str, int]) -> list[Choice]:
        """Every candidate, best first: the choice, then the fallbacks a caller tries if it cannot take
        the request (Ray skips a replica whose queue is full)."""
        if not loads:
            raise NoReplicaError("no replica to route to")
        min_load = min(loads.values())
        if key is None:
            ids = list(loads)
            self._rng.shuffle(ids)
            ids.sort(key=loads.__getitem__)
            return [Choice(i, "least_loaded", None) for i in ids]
        ranked = self.rank(key, list(loads))
        owner = ranked[0] if self._placement is None else self._placement.owner(key, ranked)
        if owner != ranked[0]:
            ranked = [owner, *(r for r in ranked if r != owner)]
        if not self.guard.is_overloaded(loads[owner], min_load):
            return [Choice(i, "affinity" if i == owner else "least_loaded", owner) for i in ranked]
        spill = sorted(ranked, key=loads.__getitem__)  # stable: equal loads keep rendezvous order
        return [Choice(i, "load_guard", owner) for i in spill]

    def record(self, key: bytes | None, replica_id: str) -> None:
        """Count one request (with `key`, None: without) as sent to `replica_id`: the recent traffic that
        bounds each replica's share. Call once per request, with the replica it was given to."""
        if self._placement is not None:
            self._placement.record(key, replica_id)


@functools.lru_cache(maxsize=1 << 14)
def _rank(key: bytes, replica_ids: tuple[str, ...]) -> tuple[str, ...]:
    def weight(replica_id: str) -> bytes:
        return hashlib.blake2b(key + b"\0" + replica_id.encode(), digest_size=8).digest()

    return tuple(sorted(replica_ids, key=weight, reverse=True))
