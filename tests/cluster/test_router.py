"""CacheAffinityRouter.choose_replicas with Ray's collaborators faked: keys, loads, retries and the balance
bound as Ray calls them (the real-Ray behaviour is in test_ray_serve.py)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import random
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from promptcache.cluster.forwarded import ForwardedRequest
from promptcache.cluster.policy import RoutingPolicy
from promptcache.cluster.router import CacheAffinityRouter

REPLICA_IDS = ["replica-a", "replica-b"]


class _IdleReplicasRouter(CacheAffinityRouter):
    """The router with Ray's queue-length cache replaced: every replica reports 0 requests in flight."""

    replica_queue_len_cache = SimpleNamespace(get=lambda replica_id: 0)
    _use_replica_queue_len_cache = False  # Ray's on_send_request then leaves the (absent) cache alone


def _router(**kwargs) -> tuple[CacheAffinityRouter, list]:
    router = object.__new__(_IdleReplicasRouter)  # Ray's constructor needs a running deployment
    router.initialize_state(**kwargs)
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=i)) for i in REPLICA_IDS]
    return router, replicas


def _request(schema: str, request_id: str) -> SimpleNamespace:
    prompt = f'<prompt schema="{schema}"><user><doc1/>Question?</user><assistant/></prompt>'
    forwarded = ForwardedRequest("POST", "/v1/generate", body=json.dumps({"prompt": prompt}).encode())
    return SimpleNamespace(args=[forwarded], metadata=SimpleNamespace(internal_request_id=request_id))


def _schemas_owned_by(replica_id: str, n: int, router: CacheAffinityRouter) -> list[str]:
    from promptcache.cluster.affinity import affinity_key

    names = []
    for i in range(1000):
        key = affinity_key(_request(f"kb{i}", "probe").args[0], router.tenants, router.affinity)
        if RoutingPolicy.rank(key.digest, REPLICA_IDS)[0] == replica_id:
            names.append(f"kb{i}")
        if len(names) == n:
            return names
    raise AssertionError("not enough schemas")


def _route(router, replicas, request, *, send: bool = True) -> str:
    """The replica chosen for `request`; `send`: then sent there, as Ray does when its queue has room."""
    ranks = asyncio.run(router.choose_replicas(replicas, request))
    if send:
        router.on_send_request(ranks[0][0].replica_id)
    return ranks[0][0].replica_id.unique_id


def test_schemas_the_hash_piles_on_one_replica_are_balanced_by_whole_schemas():
    router, replicas = _router(pml_key="schema")
    schemas = _schemas_owned_by("replica-a", 4, router)
    sequence = [s for s in schemas for _ in range(30)]
    random.Random(0).shuffle(sequence)
    served = collections.defaultdict(list)
    for n, schema in enumerate(sequence):
        served[schema].append(_route(router, replicas, _request(schema, f"r{n}")))
    counts = collections.Counter(r for replicas_of in served.values() for r in replicas_of)
    assert max(counts.values()) / (len(sequence) / 2) <= 1.3, counts
    assert sorted(len(set(r)) for r in served.values()) == [1, 1, 2, 2]  # two schemas moved, once each


def test_a_retried_request_is_counted_once():
    router, replicas = _router(pml_key="schema")
    (schema,) = _schemas_owned_by("replica-a", 1, router)
    request = _request(schema, "same-request")
    for _ in range(50):  # Ray asks again while the chosen replica's queue is full
        assert _route(router, replicas, request) == "replica-a"
    (other,) = [s for s in _schemas_owned_by("replica-a", 2, router) if s != schema]
    assert _route(router, replicas, _request(other, "next")) == "replica-a"  # 1 request recorded, not 50


def test_without_the_bound_keys_stay_on_the_hash_owner():
    router, replicas = _router(pml_key="schema", balance_factor=None)
    schemas = _schemas_owned_by("replica-a", 4, router)
    assert {_route(router, replicas, _request(s, f"r{n}")) for n, s in enumerate(schemas * 30)} == {"replica-a"}


def test_a_burst_chosen_before_ray_sends_any_of_it_spreads_once_the_owner_is_busier():
    """Ray counts a request in its queue lengths only when it sends it, after choose_replicas returns: a burst
    is chosen against the same counts. The router counts its own unsent choices, so the load guard still spills."""
    router, replicas = _router(pml_key="schema", balance_factor=None, abs_threshold=2)
    (schema,) = _schemas_owned_by("replica-a", 1, router)
    burst = [_route(router, replicas, _request(schema, f"burst{n}"), send=False) for n in range(10)]
    assert burst[:3] == ["replica-a"] * 3 and burst[3] == "replica-b", burst  # owner 3 in flight vs 0: > 2 more
    assert max(collections.Counter(burst).values()) <= 6, burst
    for replica in replicas:  # Ray sends them: the choices now count in its cache (0 here), no longer here
        for _ in range(burst.count(replica.replica_id.unique_id)):
            router.on_send_request(replica.replica_id)
    assert {_route(router, replicas, _request(schema, f"after{n}")) for n in range(10)} == {"replica-a"}


def test_an_unsent_choice_stops_counting_after_its_ttl(monkeypatch):
    """A choice Ray never sends (the replica was full: it sent to a fallback) is load only for a while."""
    router, replicas = _router(pml_key="schema", balance_factor=None, abs_threshold=2)
    (schema,) = _schemas_owned_by("replica-a", 1, router)
    # The globals the router's methods read (another test may have imported the package afresh since).
    router_globals = CacheAffinityRouter._num_unsent.__globals__
    ticks = itertools.count(step=router_globals["UNSENT_CHOICE_TTL_S"] + 1)  # each reading a TTL and more later
    monkeypatch.setitem(router_globals, "time", SimpleNamespace(monotonic=lambda: float(next(ticks))))
    assert {_route(router, replicas, _request(schema, f"r{n}"), send=False) for n in range(10)} == {"replica-a"}


def test_a_2_mib_body_is_routed_to_its_schemas_owner_from_its_prefix_in_bounded_time():
    """The router reads a body's first 64 KiB: a prompt whose schema opens it goes to the schema's owner, and the
    rest of the body costs nothing. Here the rest is 2 MiB of empty lists beside the prompt (json.loads of the whole
    body, on the gateway's event loop for every request, took ~0.7 s on an idle machine; the prefix ~20 ms)."""
    router, replicas = _router(pml_key="schema", balance_factor=None)
    (schema,) = _schemas_owned_by("replica-b", 1, router)
    prompt = f'<prompt schema="{schema}"><user><doc1/>Question?</user><assistant/></prompt>'
    body = json.dumps({"prompt": prompt, "stop": [[]] * ((2 << 20) // 4)}).encode()
    forwarded = ForwardedRequest("POST", "/v1/generate", body=body)
    request = SimpleNamespace(args=[forwarded], metadata=SimpleNamespace(internal_request_id="large"))
    started = time.perf_counter()
    assert _route(router, replicas, request) == "replica-b"
    assert time.perf_counter() - started < 0.25
