"""Readiness of the replicas for the gateway's /health: ready once Ray runs every replica its deployment
targets. A replica runs only once its engine started (replica.py's `check_health`), so a client waiting for
/health never sends its first requests to a half-started cluster."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

# At or above the target: a deployment scaling up serves with the replicas it had; UPDATING (starting, replacing
# a dead replica), UNHEALTHY and DEPLOY_FAILED are below it.
READY_STATUSES = frozenset({"HEALTHY", "UPSCALING", "DOWNSCALING"})
RUNNING = "RUNNING"


@dataclass(frozen=True, slots=True)
class DeploymentHealth:
    """Ray's view of the replicas' deployment: its status and how many replicas are in each state."""

    status: str
    replicas: dict[str, int] = field(default_factory=dict)

    @property
    def is_ready(self) -> bool:
        return self.status in READY_STATUSES and self.replicas.get(RUNNING, 0) > 0


class ReplicaReadiness:
    """Reads the deployment's status from Serve's controller, at most once per `cache_s` (probes may come
    often; the answer is a controller call)."""

    def __init__(self, app_name: str, deployment_name: str, cache_s: float = 1.0) -> None:
        self.app_name = app_name
        self.deployment_name = deployment_name
        self.cache_s = cache_s
        self._last: tuple[float, DeploymentHealth] | None = None

    async def health(self) -> DeploymentHealth:
        now = time.monotonic()
        if self._last is None or now - self._last[0] > self.cache_s:
            self._last = (now, await asyncio.to_thread(self.read))
        return self._last[1]

    def read(self) -> DeploymentHealth:
        """The deployment's health now (a blocking call to Serve's controller)."""
        from ray import serve

        application = serve.status().applications.get(self.app_name)
        deployment = application.deployments.get(self.deployment_name) if application is not None else None
        if deployment is None:
            return DeploymentHealth("NOT_DEPLOYED")
        return DeploymentHealth(_name(deployment.status),
                                {_name(state): count for state, count in deployment.replica_states.items()})


def _name(value: object) -> str:
    return str(getattr(value, "value", value))
