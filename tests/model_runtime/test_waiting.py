"""The waiting queues alone: round-robin across tenants, FCFS within one, parking, O(1) removal, and the
per-tenant bound counted from reservation to departure."""

from __future__ import annotations

import threading

import pytest

from promptcache.model_runtime.engine.request import Request
from promptcache.model_runtime.engine.waiting import WaitingRequests
from promptcache.model_runtime.errors import InvalidRequestError, QueueFullError
from promptcache.model_runtime.sampling import SamplingParams


def _request(request_id: str, tenant: str | None) -> Request:
    return Request(request_id, None, SamplingParams(), None, tenant=tenant)  # the queues never read the plan


def _queue(waiting: WaitingRequests, tenant: str | None, *ids: str) -> None:
    waiting.reserve(tenant, len(ids))
    for request_id in ids:
        waiting.add(_request(request_id, tenant))


def _admit_all(waiting: WaitingRequests) -> list[str]:
    order = []
    while (request := waiting.head()) is not None:
        waiting.pop(request)
        order.append(request.request_id)
    return order


def test_tenants_take_turns_and_each_is_fcfs():
    waiting = WaitingRequests(max_per_tenant=10)
    _queue(waiting, "a", "a0", "a1", "a2", "a3")
    _queue(waiting, None, "d0")
    _queue(waiting, "b", "b0", "b1")
    assert _admit_all(waiting) == ["a0", "d0", "b0", "a1", "b1", "a2", "a3"]
    assert len(waiting) == 0


def test_a_tenant_arriving_late_waits_behind_one_request_of_each_tenant_ahead():
    waiting = WaitingRequests(max_per_tenant=100)
    _queue(waiting, "a", *[f"a{i}" for i in range(50)])
    first = waiting.head()
    waiting.pop(first)
    _queue(waiting, "b", "b0")
    assert _admit_all(waiting)[:2] == ["a1", "b0"]


def test_a_parked_request_is_overtaken_then_resumes_at_the_front_of_its_tenant():
    waiting = WaitingRequests(max_per_tenant=10)
    _queue(waiting, "a", "a0", "a1", "a2")
    _queue(waiting, "b", "b0")
    waiting.park(waiting.head())  # a0 waits for its module KV; a keeps the turn
    assert waiting.head().request_id == "a1"
    waiting.pop(waiting.head())
    assert waiting.head().request_id == "b0"
    waiting.resume("a0")
    assert _admit_all(waiting) == ["b0", "a0", "a2"]
    waiting.resume("a0")  # no longer parked: nothing happens
    assert len(waiting) == 0


def test_remove_takes_a_request_out_from_anywhere():
    waiting = WaitingRequests(max_per_tenant=10)
    _queue(waiting, "a", "a0", "a1", "a2")
    _queue(waiting, "b", "b0")
    waiting.park(waiting.head())
    assert waiting.remove("a1").request_id == "a1" and waiting.remove("a0").request_id == "a0"
    assert waiting.remove("a1") is None and waiting.remove("nope") is None
    assert "a2" in waiting and "a1" not in waiting
    assert _admit_all(waiting) == ["a2", "b0"]


def test_the_bound_is_per_tenant_all_or_none_and_freed_when_requests_leave():
    waiting = WaitingRequests(max_per_tenant=3)
    _queue(waiting, "a", "a0", "a1")
    with pytest.raises(QueueFullError) as full:
        waiting.reserve("a", 2)  # one place left: none is taken
    assert full.value.retry_after_s >= 1
    _queue(waiting, "a", "a2")
    with pytest.raises(QueueFullError):
        waiting.reserve("a")
    _queue(waiting, "b", "b0", "b1", "b2")  # another tenant's queue is its own
    with pytest.raises(InvalidRequestError, match="at most 3"):
        waiting.reserve("c", 4)  # could never fit: not a retry
    waiting.pop(waiting.head())  # admitted
    waiting.remove("a2")  # aborted
    _queue(waiting, "a", "a3", "a4")
    with pytest.raises(QueueFullError):
        waiting.reserve("a")
    assert sorted(r.request_id for r in waiting.drain()) == ["a1", "a3", "a4", "b0", "b1", "b2"]
    _queue(waiting, "a", "a5", "a6", "a7")
    _queue(waiting, "b", "b3", "b4", "b5")


def test_reservations_from_many_threads_never_pass_the_bound():
    waiting = WaitingRequests(max_per_tenant=100)
    granted = []

    def reserve() -> None:
        for _ in range(50):
            try:
                waiting.reserve("a")
            except QueueFullError:
                continue
            granted.append(1)

    threads = [threading.Thread(target=reserve) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(granted) == 100


def test_waiting_tenants_count_parked_requests_until_they_leave():
    waiting = WaitingRequests(max_per_tenant=10)
    _queue(waiting, "a", "a0")
    _queue(waiting, "b", "b0", "b1")
    waiting.park(waiting.head())  # a0 waits for its module KV: a still waits
    assert waiting.tenants() == {"b"} and waiting.waiting_tenants() == {"a", "b"}
    waiting.remove("a0")
    assert waiting.waiting_tenants() == {"b"}
    waiting.park(waiting.head())
    waiting.resume("b0")
    waiting.pop(waiting.head())
    waiting.pop(waiting.head())
    assert waiting.waiting_tenants() == set() and len(waiting) == 0
