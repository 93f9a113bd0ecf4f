"""CacheAffinityRouter: Ray Serve's request-router extension point around the pure RoutingPolicy. Ray builds one
per caller of the replicas' deployment handle (the gateway) and calls `choose_replicas` for each request,
whose first argument is the ForwardedRequest. The first replica returned gets it unless its queue is full."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, defaultdict, deque
from typing import Any, Literal

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from promptcache.cluster.affinity import AffinityConfig, AffinityKey, affinity_key
from promptcache.cluster.forwarded import ForwardedRequest
from promptcache.cluster.placement import BalanceBound
from promptcache.cluster.policy import DEFAULT_BALANCE, LoadGuard, RoutingPolicy
from promptcache.server.settings import ServerSettings
from promptcache.server.tenants import Quota, TenantDirectory

logger = logging.getLogger(__name__)
DEFAULT_AFFINITY = AffinityConfig()
DEFAULT_GUARD = LoadGuard()
MAX_REMEMBERED_KEYS = 4096  # keys of requests still being routed (a request may take several attempts)
# A choice Ray has not sent yet counts as load on its replica, for this long at most: Ray sends to a fallback
# instead when the replica's queue turns out full, and no send to the chosen one follows.
UNSENT_CHOICE_TTL_S = 2.0


class CacheAffinityRouter(RequestRouter):
    def initialize_state(self, settings: dict[str, Any] | None = None,  # type: ignore[override]  # Ray: **kwargs
                         prefix_chars: int = DEFAULT_AFFINITY.prefix_chars,
                         pml_key: Literal["modules", "schema"] = DEFAULT_AFFINITY.pml_key,
                         abs_threshold: int = DEFAULT_GUARD.abs_threshold,
                         rel_threshold: float = DEFAULT_GUARD.rel_threshold,
                         balance_factor: float | None = DEFAULT_BALANCE.factor) -> None:
        """Called by Ray with the deployment's `request_router_kwargs`. `settings`: the replicas' explicit
        ServerSettings fields (API keys resolve to tenants as in the replicas). `balance_factor`: BalanceBound."""
        resolved = ServerSettings(**(settings or {}))
        self.tenants = TenantDirectory.load(resolved.api_keys_file, resolved.api_keys, Quota())
        self.affinity = AffinityConfig(prefix_chars=prefix_chars, pml_key=pml_key)
        balance = None if balance_factor is None else BalanceBound(factor=balance_factor)
        self.policy = RoutingPolicy(LoadGuard(abs_threshold=abs_threshold, rel_threshold=rel_threshold), balance)
        self._keys: OrderedDict[str, AffinityKey | None] = OrderedDict()
        # Per replica: when each first choice of it not yet sent was made. Ray counts a request in its queue-length
        # cache only once it sends it, several awaits after choose_replicas: in a burst, every request would
        # otherwise be chosen against the same counts (all of them to a key's owner).
        self._unsent: defaultdict[str, deque[float]] = defaultdict(deque)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key, first_attempt = self._key(pending_request)
        loads = {replica_id: n + self._num_unsent(replica_id)
                 for replica_id, n in (await self._loads(candidate_replicas)).items()}
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        digest = None if key is None else key.digest
        order = self.policy.order(digest, loads)
        if first_attempt:  # a retry (the first choice's queue was full) is not a second request
            self.policy.record(digest, order[0].replica_id)
            self._unsent[order[0].replica_id].append(time.monotonic())
        return [[by_id[order[0].replica_id]], [by_id[c.replica_id] for c in order[1:]]]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """Ray sent a request to `replica_id` and counts it in its cache now: one choice of it stops counting here."""
        super().on_send_request(replica_id)
        if unsent := self._unsent.get(replica_id.unique_id):
            unsent.popleft()

    def _num_unsent(self, replica_id: str) -> int:
        unsent, expired = self._unsent[replica_id], time.monotonic() - UNSENT_CHOICE_TTL_S
        while unsent and unsent[0] < expired:
            unsent.popleft()
        return len(unsent)

    def _key(self, pending_request: PendingRequest | None) -> tuple[AffinityKey | None, bool]:
        """The request's affinity key, and whether this is the first time the request is routed."""
        if pending_request is None or not pending_request.args:
            return None, True
        request = pending_request.args[0]
        if not isinstance(request, ForwardedRequest):
            return None, True
        request_id = pending_request.metadata.internal_request_id
        if request_id in self._keys:
            return self._keys[request_id], False
        try:
            key = affinity_key(request, self.tenants, self.affinity)
        except Exception:  # a request we cannot read is routed by load; the replica judges it
            logger.exception("computing the affinity key failed")
            key = None
        self._keys[request_id] = key
        while len(self._keys) > MAX_REMEMBERED_KEYS:
            self._keys.popitem(last=False)
        return key, True

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests in flight per replica: Ray's cached counts, probing the replicas that have none."""
        cached = {r.replica_id.unique_id: self.replica_queue_len_cache.get(r.replica_id) for r in replicas}
        loads = {replica_id: n for replica_id, n in cached.items() if n is not None}
        if missing := [r for r in replicas if r.replica_id.unique_id not in loads]:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                loads[replica.replica_id.unique_id] = queue_len or 0
        return loads
