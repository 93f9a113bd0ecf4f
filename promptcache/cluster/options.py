"""ClusterOptions: how many replicas, what each gets, and how requests are routed to them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from promptcache.cluster.errors import ClusterConfigError


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    num_replicas: int = 2
    max_replicas: int | None = None  # above num_replicas: Ray autoscales between them on queue length
    target_ongoing_requests: float = 4.0  # autoscaling target: requests in flight per replica
    max_ongoing_requests: int = 16  # a replica is sent no more at once (Ray's queue limit)
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    router: Literal["affinity", "default"] = "affinity"  # default: Ray's power-of-two-choices router
    prefix_chars: int = 256  # affinity.AffinityConfig
    pml_key: Literal["modules", "schema"] = "modules"  # affinity.AffinityConfig
    abs_threshold: int = 4  # policy.LoadGuard
    rel_threshold: float = 1.5  # policy.LoadGuard
    balance_factor: float | None = 1.2  # placement.BalanceBound: a replica's share of recent requests
    health_check_period_s: float = 2.0
    num_gateways: int = 1

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ClusterConfigError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if self.max_replicas is not None and self.max_replicas < self.num_replicas:
            raise ClusterConfigError(f"max_replicas ({self.max_replicas}) must be at least num_replicas "
                                     f"({self.num_replicas})")
        if self.max_ongoing_requests < 1:
            raise ClusterConfigError(f"max_ongoing_requests must be at least 1, got {self.max_ongoing_requests}")
        if self.num_cpus_per_replica < 0 or self.num_gpus_per_replica < 0:
            raise ClusterConfigError("num_cpus_per_replica and num_gpus_per_replica must be >= 0")
        if self.pml_key not in ("modules", "schema"):
            raise ClusterConfigError(f"pml_key must be 'modules' or 'schema', got {self.pml_key!r}")
        if self.router not in ("affinity", "default"):
            raise ClusterConfigError(f"router must be 'affinity' or 'default', got {self.router!r}")
        if self.balance_factor is not None and self.balance_factor < 1:
            raise ClusterConfigError(f"balance_factor must be >= 1 (or null: no bound), got {self.balance_factor}")
        if self.num_gateways < 1:
            raise ClusterConfigError(f"num_gateways must be at least 1, got {self.num_gateways}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ClusterOptions:
        """From a config file's mapping; an unknown name is an error naming it."""
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(values) - known):
            raise ClusterConfigError(f"unknown cluster option(s) {unknown}; expected some of {sorted(known)}")
        return cls(**values)

    @property
    def num_threads(self) -> int:
        """Torch threads per replica: its CPUs, at least one."""
        return max(1, int(self.num_cpus_per_replica))
