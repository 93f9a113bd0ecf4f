"""Scale-out on Ray Serve: N promptcache replicas on one Redis behind a cache-affinity request router.
The names here are pure (no Ray import), shared by the routing simulator and tests. The Ray side (`.app`,
`.router`, `.replica`, `.gateway`) needs the `cluster` extra (`pip install 'promptcache[cluster]'`)."""

from promptcache.cluster.affinity import AffinityConfig, AffinityKey, affinity_key
from promptcache.cluster.errors import (
    ClusterConfigError,
    ClusterError,
    NoReplicaError,
    ReplicaLostError,
    ReplicasBusyError,
    ReplicaStartError,
    RequestTooLargeError,
)
from promptcache.cluster.forwarded import ForwardedRequest
from promptcache.cluster.options import ClusterOptions
from promptcache.cluster.policy import Choice, LoadGuard, RoutingPolicy

__all__ = ["AffinityConfig", "AffinityKey", "Choice", "ClusterConfigError", "ClusterError", "ClusterOptions",
           "ForwardedRequest", "LoadGuard", "NoReplicaError", "ReplicaLostError", "ReplicaStartError",
           "ReplicasBusyError", "RequestTooLargeError", "RoutingPolicy", "affinity_key"]
