"""PromptCacheReplica's health check, which Ray runs once before routing anything to a replica: it holds
the replica back until its app's engine has started, and fails a replica whose engine could not start
(Ray's deployment machinery is not needed: the check reads only the app's state)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from promptcache.cluster import ReplicaStartError
from promptcache.cluster.replica import PromptCacheReplica


def _replica(state: SimpleNamespace) -> PromptCacheReplica:
    replica = object.__new__(PromptCacheReplica)  # Ray's constructor needs a running deployment
    replica.replica_id, replica.fastapi = "r1", SimpleNamespace(state=state)
    return replica


def test_the_first_health_check_waits_for_the_engine_to_start():
    state = SimpleNamespace(service=None, load_error=None)

    async def scenario() -> None:
        check = asyncio.create_task(_replica(state).check_health())
        await asyncio.sleep(0.3)
        assert not check.done()  # still starting: Ray keeps the replica out of routing
        state.service = object()
        await asyncio.wait_for(check, timeout=5)

    asyncio.run(scenario())


def test_a_replica_whose_engine_failed_to_start_fails_its_health_check():
    state = SimpleNamespace(service=None, load_error="startup failed (id 0123456789ab)")
    with pytest.raises(ReplicaStartError, match="failed to start"):
        asyncio.run(_replica(state).check_health())
