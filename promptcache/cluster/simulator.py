"""Routing simulator: the real RoutingPolicy against Ray's default policy, with no model and no Ray.
Replicas have a few slots and an LRU device tier counted in modules. Poisson arrivals pick a schema by Zipf
popularity and one of its module sets (the affinity key; `affinity_schema` keys on the schema alone), and take
`base_s` plus `miss_s` per module their replica's device tier lacks. Loads are requests queued or running.
`python -m promptcache.cluster.simulator --replicas 16 64` prints one JSON line per (replicas, policy)."""

from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import json
import random
import statistics
import sys
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from promptcache.cluster.errors import ClusterConfigError
from promptcache.cluster.placement import BalanceBound
from promptcache.cluster.policy import LoadGuard, RoutingPolicy

POLICIES = ("affinity", "affinity_schema", "power_of_two", "random")


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    num_replicas: int = 16
    num_schemas_per_replica: int = 4
    zipf_alpha: float = 1.0
    modules_per_schema: int = 6
    modules_per_request: int = 2
    module_sets_per_schema: int = 6  # distinct module sets (affinity keys) per schema
    device_modules_per_replica: int = 48  # device tier capacity, in modules
    slots_per_replica: int = 4  # requests a replica runs at once
    base_s: float = 0.1  # new text and decode
    miss_s: float = 0.05  # per module not in the device tier: a fetch from Redis
    utilization: float = 0.6  # arrival rate, as a share of what the replicas serve when every module hits
    num_requests_per_replica: int = 400
    abs_threshold: int = 4
    rel_threshold: float = 1.5
    balance_factor: float | None = 1.2  # placement.BalanceBound (None: keys stay where the hash puts them)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.num_schemas_per_replica < 1 or self.slots_per_replica < 1:
            raise ClusterConfigError("num_replicas, num_schemas_per_replica and slots_per_replica must be at least 1")
        if not 1 <= self.modules_per_request <= self.modules_per_schema:
            raise ClusterConfigError("modules_per_request must be between 1 and modules_per_schema")
        if not 0 < self.utilization < 1:
            raise ClusterConfigError(f"utilization must be in (0, 1), got {self.utilization}")


@dataclass(frozen=True, slots=True)
class SimulationResult:
    policy: str
    num_replicas: int
    num_requests: int
    device_hit_rate: float  # modules found in the serving replica's device tier / modules needed
    max_over_mean_requests: float  # requests served by the busiest replica / mean per replica
    p50_latency_s: float
    p99_latency_s: float


@dataclass
class _Replica:
    capacity: int
    slots: int
    cache: OrderedDict[tuple[int, int], None] = field(default_factory=OrderedDict)
    running: int = 0
    waiting: list[tuple[float, float]] = field(default_factory=list)  # FIFO of (arrival, service_s)
    num_served: int = 0

    @property
    def load(self) -> int:
        return self.running + len(self.waiting)

    def lookup(self, modules: list[tuple[int, int]]) -> int:
        """Modules found in the device tier; all of them are there (most recently used) afterwards."""
        hits = 0
        for module in modules:
            if module in self.cache:
                hits += 1
                self.cache.move_to_end(module)
            else:
                self.cache[module] = None
                if len(self.cache) > self.capacity:
                    self.cache.popitem(last=False)
        return hits


def simulate(config: SimulationConfig, policy_name: str) -> SimulationResult:
    """Run one policy (`affinity`, `affinity_schema`, `power_of_two` or `random`) on the workload of `config`."""
    if policy_name not in POLICIES:
        raise ClusterConfigError(f"policy must be one of {POLICIES}, got {policy_name!r}")
    rng = random.Random(config.seed)  # same seed, same arrivals and request mix for every policy
    choice_rng = random.Random(config.seed + 1)
    balance = None if config.balance_factor is None else BalanceBound(factor=config.balance_factor)
    policy = RoutingPolicy(LoadGuard(config.abs_threshold, config.rel_threshold), balance,
                           rng=random.Random(config.seed + 2))
    replica_ids = [f"replica-{i}" for i in range(config.num_replicas)]
    replicas = {r: _Replica(config.device_modules_per_replica, config.slots_per_replica) for r in replica_ids}
    num_schemas = config.num_schemas_per_replica * config.num_replicas
    weights = [1 / (rank + 1) ** config.zipf_alpha for rank in range(num_schemas)]
    module_sets = [[sorted(rng.sample(range(config.modules_per_schema), config.modules_per_request))
                    for _ in range(config.module_sets_per_schema)] for _ in range(num_schemas)]
    rate = config.utilization * config.num_replicas * config.slots_per_replica / config.base_s
    num_requests = config.num_requests_per_replica * config.num_replicas
    events: list[tuple[float, int, str, str | None]] = []  # (time, seq, kind, replica)
    seq = itertools.count()
    latencies: list[float] = []
    hits = needed = 0
    now = 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        heapq.heappush(events, (now, next(seq), "arrive", None))

    def start(replica: _Replica, replica_id: str, t: float) -> None:
        while replica.running < replica.slots and replica.waiting:
            arrival, service_s = replica.waiting.pop(0)
            replica.running += 1
            latencies.append(t + service_s - arrival)
            heapq.heappush(events, (t + service_s, next(seq), "finish", replica_id))

    while events:
        t, _, kind, replica_id = heapq.heappop(events)
        if kind == "finish":
            assert replica_id is not None, "a finish names its replica"
            replica = replicas[replica_id]
            replica.running -= 1
            start(replica, replica_id, t)
            continue
        schema = rng.choices(range(num_schemas), weights)[0]
        modules_index = rng.randrange(config.module_sets_per_schema)
        key_text = f"{schema}" if policy_name == "affinity_schema" else f"{schema}/{modules_index}"
        key = hashlib.blake2b(key_text.encode(), digest_size=16).digest()
        loads = {r: replicas[r].load for r in replica_ids}
        if policy_name.startswith("affinity"):
            replica_id = policy.choose(key, loads).replica_id
            policy.record(key, replica_id)
        elif policy_name == "power_of_two":  # Ray's default: two at random, the less loaded
            a, b = choice_rng.sample(replica_ids, 2) if len(replica_ids) > 1 else (replica_ids[0],) * 2
            replica_id = a if loads[a] <= loads[b] else b
        else:
            replica_id = choice_rng.choice(replica_ids)
        replica = replicas[replica_id]
        modules = [(schema, m) for m in module_sets[schema][modules_index]]
        found = replica.lookup(modules)
        hits, needed = hits + found, needed + len(modules)
        replica.num_served += 1
        replica.waiting.append((t, config.base_s + config.miss_s * (len(modules) - found)))
        start(replica, replica_id, t)
    served = [r.num_served for r in replicas.values()]
    quantiles = statistics.quantiles(latencies, n=100)
    return SimulationResult(policy_name, config.num_replicas, num_requests, hits / needed,
                            max(served) / statistics.mean(served), quantiles[49], quantiles[98])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[16, 64])
    defaults = SimulationConfig()
    parser.add_argument("--zipf-alpha", type=float, default=defaults.zipf_alpha)
    parser.add_argument("--requests-per-replica", type=int, default=defaults.num_requests_per_replica)
    args = parser.parse_args(argv)
    for num_replicas in args.replicas:
        config = SimulationConfig(num_replicas=num_replicas, zipf_alpha=args.zipf_alpha,
                                  num_requests_per_replica=args.requests_per_replica)
        for policy_name in POLICIES:
            print(json.dumps({"config": asdict(config), **asdict(simulate(config, policy_name))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
