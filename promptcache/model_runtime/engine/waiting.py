"""Waiting requests: one bounded FCFS queue per tenant, admitted round-robin across tenants."""

from __future__ import annotations

import threading
from collections import OrderedDict

from promptcache.model_runtime.engine.request import Request
from promptcache.model_runtime.errors import InvalidRequestError, QueueFullError

RETRY_AFTER_S = 1  # a full queue drains as fast as the engine admits: a short wait, then the client retries


class WaitingRequests:
    """Requests not yet admitted, one FCFS queue per tenant (O(1) in requests): `head` is the first of the tenant whose
    turn it is, `pop` passes the turn on; a request whose module KV is encoded is `park`ed, then `resume`d at its
    queue's front. A tenant holds at most `max_per_tenant` from `reserve` (alone thread-safe) till they leave."""

    def __init__(self, max_per_tenant: int) -> None:
        self.max_per_tenant = max_per_tenant
        self._queues: OrderedDict[str | None, OrderedDict[str, Request]] = OrderedDict()  # tenants in turn order
        self._parked: dict[str, Request] = {}
        self._num_parked: dict[str | None, int] = {}  # per tenant
        self._requests: dict[str, Request] = {}  # every request queued or parked, by id
        self._counts: dict[str | None, int] = {}  # per tenant: reserved and not yet left
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def reserve(self, tenant: str | None, num_requests: int = 1) -> None:
        """Hold places for `num_requests` of `tenant`, all or none (QueueFullError; InvalidRequestError if never)."""
        if num_requests > self.max_per_tenant:
            raise InvalidRequestError(f"this request queues {num_requests} prompts; a tenant may have at most "
                                      f"{self.max_per_tenant} waiting (send fewer prompts per request)")
        with self._lock:
            count = self._counts.get(tenant, 0)
            if count + num_requests > self.max_per_tenant:
                raise QueueFullError(f"this tenant has {count} requests waiting, at most {self.max_per_tenant} "
                                     "may wait; retry after the ones queued are admitted",
                                     retry_after_s=RETRY_AFTER_S)
            self._counts[tenant] = count + num_requests

    def add(self, request: Request) -> None:
        """Queue a request whose place was reserved; a tenant new to the rotation takes its turn last."""
        self._requests[request.request_id] = request
        self._queues.setdefault(request.tenant, OrderedDict())[request.request_id] = request

    def tenants(self) -> set[str | None]:
        """Tenants with requests queued (parked ones aside). O(number of tenants)."""
        return set(self._queues)

    def waiting_tenants(self) -> set[str | None]:
        """Tenants with requests queued or parked. O(number of tenants)."""
        return set(self._queues) | set(self._num_parked)

    def head(self, skip: frozenset[str | None] | set[str | None] = frozenset()) -> Request | None:
        """The first request of the tenant whose turn it is, tenants in `skip` passed over. O(number of tenants)."""
        for tenant, queue in self._queues.items():
            if tenant not in skip:
                return next(iter(queue.values()))
        return None

    def pop(self, request: Request) -> None:
        """Remove the head `request` (admitted or refused); the turn passes to the next tenant."""
        self._unqueue(request)
        if request.tenant in self._queues:
            self._queues.move_to_end(request.tenant)
        self._leave(request)

    def park(self, request: Request) -> None:
        """Set the head `request` aside while its module KV is encoded; its tenant keeps the turn."""
        self._unqueue(request)
        self._parked[request.request_id] = request
        self._num_parked[request.tenant] = self._num_parked.get(request.tenant, 0) + 1

    def resume(self, request_id: str) -> None:
        """A parked request's encodings finished: back to its queue's front (no-op if it left meanwhile)."""
        request = self._parked.pop(request_id, None)
        if request is not None:
            self._unpark(request)
            queue = self._queues.setdefault(request.tenant, OrderedDict())
            queue[request_id] = request
            queue.move_to_end(request_id, last=False)

    def remove(self, request_id: str) -> Request | None:
        """Take a request out wherever it waits (aborted, failed); None if it is not waiting."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if self._parked.pop(request_id, None) is None:
            self._unqueue(request)
        else:
            self._unpark(request)
        self._leave(request)
        return request

    def drain(self) -> list[Request]:
        """Remove and return every waiting request."""
        requests = list(self._requests.values())
        for request in requests:
            self.remove(request.request_id)
        return requests

    def _unqueue(self, request: Request) -> None:
        queue = self._queues[request.tenant]
        del queue[request.request_id]
        if not queue:
            del self._queues[request.tenant]

    def _unpark(self, request: Request) -> None:
        count = self._num_parked[request.tenant] - 1
        if count > 0:
            self._num_parked[request.tenant] = count
        else:
            del self._num_parked[request.tenant]

    def _leave(self, request: Request) -> None:
        del self._requests[request.request_id]
        with self._lock:
            count = self._counts.get(request.tenant, 0) - 1
            if count > 0:
                self._counts[request.tenant] = count
            else:
                self._counts.pop(request.tenant, None)
