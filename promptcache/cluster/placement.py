"""KeyPlacement: which replica owns an affinity key, rendezvous order first, within a bound on recent load.
Consistent hashing with bounded loads (Mirrokni, Thorup & Zadimoghaddam, 2018), weighted by traffic instead of
key counts: with the few hot keys real PML traffic has, rendezvous hashing alone can give one replica most of
them, and the load guard never fires below saturation (docs/scaling.md). State is per router."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from promptcache.cluster.errors import ClusterConfigError

RESCALE_AT = 2.0 ** 512  # increments grow as 2^(t / half_life): rescale everything before floats overflow


@dataclass(frozen=True, slots=True)
class BalanceBound:
    """How far a replica's recent traffic may exceed the mean before one of its keys moves."""

    factor: float = 1.2  # a replica may carry up to factor x the mean of recent requests
    slack: float = 4.0  # ... plus this many requests
    half_life: float = 512.0  # requests after which a request counts half

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ClusterConfigError(f"balance factor must be >= 1, got {self.factor}")
        if self.slack < 1:
            raise ClusterConfigError(f"balance slack must be >= 1 request, got {self.slack}")
        if self.half_life <= 0:
            raise ClusterConfigError(f"balance half_life must be > 0 requests, got {self.half_life}")


class KeyPlacement:
    """Requests count towards their replica and key, decayed (`half_life` requests). A key belongs to the first
    replica in its rendezvous order whose recent load, with the key's weight, stays within `factor` x the mean
    (+ `slack`); a moved key takes its weight along and returns only once its first choice would stay within the
    mean (+ `slack`) with it. When no replica has room the key stays: splitting one hot key is the guard's job."""

    def __init__(self, bound: BalanceBound = BalanceBound(), max_keys: int = 1 << 16) -> None:
        self.bound = bound
        self._max_keys = max_keys
        self._owners: OrderedDict[bytes, str] = OrderedDict()  # key -> replica, least recently used first
        self._key_load: dict[bytes, float] = {}
        self._load: dict[str, float] = {}
        self._increment = 1.0  # what one request adds now: 2^(requests so far / half_life)
        self._growth = math.pow(2.0, 1.0 / bound.half_life)

    def owner(self, key: bytes, ranked: Sequence[str]) -> str:
        """The replica that owns `key` among `ranked` (the candidates in the key's rendezvous order): the
        first that has room for it, placing or moving the key when that changed."""
        current = self._owners.get(key)
        mean = sum(self._load.get(r, 0.0) for r in ranked) / len(ranked)
        slack = self.bound.slack * self._increment
        limit = self.bound.factor * mean + slack
        # A known key's weight is its recent traffic (a new one's: this request); it moves with the key.
        weight = self._key_load.get(key, self._increment)
        before_owner = current in ranked
        for replica in ranked:
            load = self._load.get(replica, 0.0)
            if replica == current:
                before_owner = False
                if load <= limit:  # the owner's load includes the key
                    target = replica
                    break
            elif load + weight <= (mean + slack if before_owner else limit):
                # Taking a key back from a later choice needs room below the mean, not just the bound:
                # otherwise a key moved off a busy replica returns as soon as that one dips under the
                # bound, and pushes another key out (flapping, each move a cache miss).
                target = replica
                break
        else:  # nowhere has room for this key: it stays, or goes where its hash says
            target = current if current is not None and current in ranked else ranked[0]
        if target != current and key in self._key_load:
            if current is not None:
                self._load[current] = max(0.0, self._load.get(current, 0.0) - weight)
            self._load[target] = self._load.get(target, 0.0) + weight
        self._owners[key] = target
        self._owners.move_to_end(key)
        while len(self._owners) > self._max_keys:
            forgotten, _ = self._owners.popitem(last=False)
            self._key_load.pop(forgotten, None)
        return target

    def record(self, key: bytes | None, replica_id: str) -> None:
        """One request with `key` (None: no key) was sent to `replica_id`."""
        self._load[replica_id] = self._load.get(replica_id, 0.0) + self._increment
        if key is not None and key in self._owners:
            self._key_load[key] = self._key_load.get(key, 0.0) + self._increment
        self._increment *= self._growth
        if self._increment > RESCALE_AT:
            scale = 1.0 / self._increment
            self._load = {r: v * scale for r, v in self._load.items()}
            self._key_load = {k: v * scale for k, v in self._key_load.items()}
            self._increment = 1.0
