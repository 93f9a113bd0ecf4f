"""build_application wires the deployments as ClusterOptions say (binds only: no Ray cluster started)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (ray[serve]) is not installed")

from promptcache.cluster import ClusterConfigError, ClusterOptions
from promptcache.cluster.app import GATEWAY_DEPLOYMENT, REPLICA_DEPLOYMENT, build_application
from promptcache.cluster.router import CacheAffinityRouter


def _deployments(options: ClusterOptions, settings: dict | None = None):
    gateway = build_application(settings or {"redis_url": "redis://127.0.0.1:6379/0"}, options)._bound_deployment
    replicas = gateway.init_args[0]._bound_deployment
    return gateway, replicas


def test_fixed_replicas_with_the_affinity_router():
    gateway, replicas = _deployments(ClusterOptions(num_replicas=3, num_cpus_per_replica=2, abs_threshold=1))
    assert (gateway.name, replicas.name) == (GATEWAY_DEPLOYMENT, REPLICA_DEPLOYMENT)
    assert replicas.num_replicas == 3 and replicas._deployment_config.autoscaling_config is None
    assert replicas.ray_actor_options["num_cpus"] == 2 and gateway.ray_actor_options["num_cpus"] == 0
    # settings (an upload's KV goes to Redis only unless the settings say otherwise), torch threads
    assert replicas.init_args == ({"upload_kv_local": False, "redis_url": "redis://127.0.0.1:6379/0"}, 2)
    router = replicas._deployment_config.request_router_config
    assert router.get_request_router_class() is CacheAffinityRouter
    assert router.request_router_kwargs["abs_threshold"] == 1 and router.request_router_kwargs["pml_key"] == "modules"
    assert router.request_router_kwargs["settings"]["redis_url"] == "redis://127.0.0.1:6379/0"


def test_autoscaling_on_queue_length_and_the_default_router():
    _, replicas = _deployments(ClusterOptions(num_replicas=2, max_replicas=6, target_ongoing_requests=3,
                                              router="default"))
    autoscaling = replicas._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (2, 6, 3)
    assert "PowerOfTwoChoices" in str(replicas._deployment_config.request_router_config.request_router_class)


def test_settings_can_keep_an_uploads_kv_local():
    _, replicas = _deployments(ClusterOptions(), {"redis_url": "redis://127.0.0.1:6379/0", "upload_kv_local": True})
    assert replicas.init_args[0]["upload_kv_local"] is True


def test_invalid_settings_fail_before_ray_starts():
    with pytest.raises(ClusterConfigError, match="dtype"):
        build_application({"dtype": "int3"})
