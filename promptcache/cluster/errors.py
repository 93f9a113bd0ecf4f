"""The cluster's error tree: every exception promptcache.cluster raises derives from ClusterError."""

from __future__ import annotations


class ClusterError(Exception):
    """Root of every cluster error. A 5xx's message reaches the caller only when `is_public` (written for
    the caller, no internals in it); `retry_after_s` becomes a Retry-After header."""

    is_public = False

    def __init__(self, message: str = "", *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ClusterConfigError(ClusterError):
    """Invalid cluster options, application arguments or replica settings (raised before Ray starts)."""


class NoReplicaError(ClusterError):
    """The routing policy was asked to choose among no replicas."""


class ReplicaStartError(ClusterError):
    """A replica's engine failed to start, or did not start in time (Ray replaces the replica)."""


class RequestTooLargeError(ClusterError):
    """The request body exceeds the replicas' limit (the gateway reads it whole before choosing one), or a body
    came to a path that takes none."""


class ReplicasBusyError(ClusterError):
    """Every replica's queue is full: the gateway refuses the request rather than queue it."""

    is_public = True


class ReplicaLostError(ClusterError):
    """The replica serving a request stopped: before answering (after every retry), or mid-response."""

    is_public = True
